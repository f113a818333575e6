/* Native text passes of data preparation, each equal to a plain Python definition: the numbers the
 * cleaning filters compare (measures.py's plain functions) and the text the exact-dedup hash reads
 * (dedup.py), from passes over the str's own code points (no copy, no str per word or line).
 *
 * text_counts(text, mask=2**64-1) -> (words, non_space, symbols, lines, bullet_lines, ellipsis_lines,
 *                                     duplicate_lines, alpha)
 *   words        len(text.split())
 *   non_space    characters that are not str.isspace (= sum(map(len, text.split())))
 *   symbols      text.count("#") + text.count("...") + text.count(ELLIPSIS)
 *   lines        non-empty stripped lines of text.splitlines()
 *   bullet_lines / ellipsis_lines: of those, the ones starting with a BULLETS character / ending
 *                with one of ELLIPSES
 *   duplicate_lines: of those, the ones equal to an earlier one
 *   alpha        characters passing str.isalpha
 * duplicate_ngram_chars(text, n, mask=2**64-1) -> the characters of the words (of text.split())
 *   inside at least one word n-gram that occurs more than once.
 * ascii_normalised(text) -> bytes: for an ASCII str, dedup.normalise(text).encode(): lower case,
 *   every run of whitespace one space, none at either end.
 *
 * Character classes come from CPython's own Unicode database (Py_UNICODE_ISSPACE, _ISALPHA and
 * _ISLINEBREAK: the functions str.split, str.strip, str.splitlines and str.isalpha use), so every code point, lone surrogates included, is classed as Python classes
 * it. Equal words, n-grams and lines are found in open-addressing hash tables that compare the
 * characters (or word ids) themselves wherever hashes meet, so a collision never counts; `mask`
 * (ANDed into every hash) exists for the tests, which set it to 0 to make every hash collide.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(_MSC_VER)
#define ALWAYS_INLINE __forceinline
#else
#define ALWAYS_INLINE inline __attribute__((always_inline))
#endif

/* measures.py's BULLETS and ELLIPSES (a test checks these against them) */
static const Py_UCS4 BULLET_CHARS[] = {0x2022, 0x25CF, '-', '*', 0x2023, 0x25E6, 0x2013};
#define N_BULLETS (sizeof(BULLET_CHARS) / sizeof(BULLET_CHARS[0]))
#define ELLIPSIS_CHAR 0x2026

enum { K_SPACE = 1, K_BREAK = 2, K_ALPHA = 4 };
static unsigned char ascii_kind[128];  /* filled at import from the Py_UNICODE_* functions */

static ALWAYS_INLINE unsigned char char_kind(Py_UCS4 c) {
    if (c < 128) return ascii_kind[c];
    return (unsigned char)((Py_UNICODE_ISSPACE(c) ? K_SPACE : 0) | (Py_UNICODE_ISLINEBREAK(c) ? K_BREAK : 0) |
                           (Py_UNICODE_ISALPHA(c) ? K_ALPHA : 0));
}

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}

static uint64_t bytes_hash(const unsigned char *p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ mix64(w)) * 0x100000001B3ULL;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    return mix64(h ^ w);
}

/* A set of spans [at, at + len) of one buffer (items of `width` bytes), equal when their bytes are. */
typedef struct { Py_ssize_t at, len; uint64_t hash; int64_t count; } Span;
typedef struct {
    Span *slots;
    size_t cap, used;
    const unsigned char *base;
    size_t width;
    uint64_t mask;
} SpanSet;

static int span_set_init(SpanSet *s, size_t expected, const unsigned char *base, size_t width, uint64_t mask) {
    size_t cap = 16;
    while (cap < 2 * expected + 2) cap *= 2;
    s->slots = (Span *)calloc(cap, sizeof(Span));
    s->cap = cap;
    s->used = 0;
    s->base = base;
    s->width = width;
    s->mask = mask;
    return s->slots ? 0 : -1;
}

/* The slot holding the span equal to [at, at + len) (len > 0), inserted with count 0 when absent;
 * NULL on memory error. */
static Span *span_set_get(SpanSet *s, Py_ssize_t at, Py_ssize_t len) {
    const unsigned char *p = s->base + (size_t)at * s->width;
    size_t nbytes = (size_t)len * s->width;
    uint64_t h = bytes_hash(p, nbytes) & s->mask;
    size_t slot = (size_t)h & (s->cap - 1);
    while (s->slots[slot].len) {
        Span *q = &s->slots[slot];
        if (q->hash == h && q->len == len && memcmp(s->base + (size_t)q->at * s->width, p, nbytes) == 0) return q;
        slot = (slot + 1) & (s->cap - 1);
    }
    if (2 * (s->used + 1) > s->cap) {  /* grow, then look for the free slot again */
        size_t cap = s->cap * 2;
        Span *slots = (Span *)calloc(cap, sizeof(Span));
        if (!slots) return NULL;
        for (size_t k = 0; k < s->cap; k++) {
            if (!s->slots[k].len) continue;
            size_t j = (size_t)s->slots[k].hash & (cap - 1);
            while (slots[j].len) j = (j + 1) & (cap - 1);
            slots[j] = s->slots[k];
        }
        free(s->slots);
        s->slots = slots;
        s->cap = cap;
        slot = (size_t)h & (cap - 1);
        while (s->slots[slot].len) slot = (slot + 1) & (cap - 1);
    }
    Span *q = &s->slots[slot];
    q->at = at;
    q->len = len;
    q->hash = h;
    q->count = 0;
    s->used++;
    return q;
}

typedef struct {
    Py_ssize_t words, non_space, symbols, lines, bullets, ellipses, duplicates, alpha;
} Counts;

static ALWAYS_INLINE Py_UCS4 read_at(int kind, const void *data, Py_ssize_t i) {
    return kind == PyUnicode_1BYTE_KIND ? ((const Py_UCS1 *)data)[i]
           : kind == PyUnicode_2BYTE_KIND ? ((const Py_UCS2 *)data)[i] : ((const Py_UCS4 *)data)[i];
}

/* One stripped line [first, last] (first = -1: blank): the line rules. */
static ALWAYS_INLINE int end_line(int kind, const void *data, Py_ssize_t first, Py_ssize_t last, Counts *c,
                                  SpanSet *seen) {
    if (first < 0) return 0;
    c->lines++;
    Py_UCS4 head = read_at(kind, data, first), tail = read_at(kind, data, last);
    for (size_t b = 0; b < N_BULLETS; b++) {
        if (head == BULLET_CHARS[b]) { c->bullets++; break; }
    }
    if (tail == ELLIPSIS_CHAR || (tail == '.' && last - first >= 2 && read_at(kind, data, last - 1) == '.' &&
                                  read_at(kind, data, last - 2) == '.'))
        c->ellipses++;
    Span *q = span_set_get(seen, first, last - first + 1);
    if (!q) return -1;
    c->duplicates += q->count > 0;
    q->count++;
    return 0;
}

/* The whole text in one pass; `kind` is a constant in each inlined copy. */
static ALWAYS_INLINE int count_all(int kind, const void *data, Py_ssize_t n, Counts *c, SpanSet *seen) {
    Py_ssize_t first = -1, last = -1, dots = 0;
    int in_word = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 ch = read_at(kind, data, i);
        unsigned char k = char_kind(ch);
        if (ch == '.') {
            dots++;
        } else if (dots) {
            c->symbols += dots / 3;  /* str.count("..."): non-overlapping, so a run of k dots holds k // 3 */
            dots = 0;
        }
        c->symbols += (ch == '#') + (ch == ELLIPSIS_CHAR);
        c->alpha += (k & K_ALPHA) != 0;
        int solid = !(k & K_SPACE);  /* inside a word */
        c->non_space += solid;
        c->words += solid & !in_word;
        in_word = solid;
        first = (solid && first < 0) ? i : first;
        last = solid ? i : last;
        if (k & K_BREAK) {
            if (end_line(kind, data, first, last, c, seen) < 0) return -1;
            first = -1;  /* \r\n is one break in str.splitlines, but the blank line between changes nothing */
        }
    }
    c->symbols += dots / 3;
    return end_line(kind, data, first, last, c, seen);
}

static int ready(PyObject *text) {
#if PY_VERSION_HEX < 0x030C0000
    return PyUnicode_READY(text);
#else
    (void)text;
    return 0;
#endif
}

static PyObject *py_text_counts(PyObject *self, PyObject *args) {
    PyObject *text;
    unsigned long long mask = ~0ULL;
    if (!PyArg_ParseTuple(args, "U|K", &text, &mask) || ready(text) < 0) return NULL;
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    Counts c = {0};
    SpanSet seen;
    if (span_set_init(&seen, (size_t)(n / 64), (const unsigned char *)data, (size_t)kind, mask) < 0)
        return PyErr_NoMemory();
    int rc = kind == PyUnicode_1BYTE_KIND   ? count_all(PyUnicode_1BYTE_KIND, data, n, &c, &seen)
             : kind == PyUnicode_2BYTE_KIND ? count_all(PyUnicode_2BYTE_KIND, data, n, &c, &seen)
                                            : count_all(PyUnicode_4BYTE_KIND, data, n, &c, &seen);
    free(seen.slots);
    if (rc < 0) return PyErr_NoMemory();
    return Py_BuildValue("(nnnnnnnn)", c.words, c.non_space, c.symbols, c.lines, c.bullets, c.ellipses,
                         c.duplicates, c.alpha);
}

/* A word of text.split(): where it starts, its length in characters, a hash of its characters. */
typedef struct { Py_ssize_t at, len; uint64_t hash; } Word;

/* The words of text.split() into *out (malloc'ed); -> how many, or -1 on memory error. */
static ALWAYS_INLINE Py_ssize_t find_words(int kind, const void *data, Py_ssize_t n, uint64_t mask, Word **out) {
    size_t cap = 64, L = 0;
    Word *w = (Word *)malloc(cap * sizeof(Word));
    if (!w) return -1;
    for (Py_ssize_t i = 0;;) {
        while (i < n && (char_kind(read_at(kind, data, i)) & K_SPACE)) i++;
        if (i == n) break;
        Py_ssize_t at = i;
        uint64_t h = 0xcbf29ce484222325ULL;  /* FNV-1a over the code points */
        for (Py_UCS4 ch; i < n && !(char_kind(ch = read_at(kind, data, i)) & K_SPACE); i++)
            h = (h ^ ch) * 0x100000001B3ULL;
        if (L == cap) {
            Word *nw = (Word *)realloc(w, 2 * cap * sizeof(Word));
            if (!nw) { free(w); return -1; }
            w = nw;
            cap *= 2;
        }
        w[L].at = at;
        w[L].len = i - at;
        w[L].hash = mix64(h) & mask;
        L++;
    }
    *out = w;
    return (Py_ssize_t)L;
}

static inline int same_words(const unsigned char *data, size_t width, const Word *a, const Word *b, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        if (a[k].hash != b[k].hash || a[k].len != b[k].len ||
            memcmp(data + (size_t)a[k].at * width, data + (size_t)b[k].at * width, (size_t)a[k].len * width))
            return 0;
    }
    return 1;
}

/* An n-gram in the table: its key, where it first starts, how often it occurs. */
typedef struct { uint64_t key; Py_ssize_t first, count; } Gram;

/* Characters of the words inside repeated n-grams (module comment); -1 on memory error. N-gram
 * i's key is sum_k hash(word i+k) * C_k (mod 2^64, odd C_k); equal keys are confirmed by comparing
 * the words, so only equal n-grams count. */
static Py_ssize_t repeated_chars(const unsigned char *data, size_t width, const Word *w, Py_ssize_t L, Py_ssize_t n,
                                 uint64_t mask) {
    Py_ssize_t m = L - n + 1, covered = -1, cover_end = 0;
    size_t cap = 16;
    while (cap < 2 * (size_t)m) cap *= 2;  /* at most half full: it never grows */
    Gram *table = (Gram *)calloc(cap, sizeof(Gram));  /* count 0: an empty slot */
    size_t *slot_of = (size_t *)malloc((size_t)m * sizeof(size_t));  /* n-gram i -> its slot */
    if (!table || !slot_of) goto done;
    for (Py_ssize_t i = 0; i < m; i++) {
        uint64_t key = 0, c = 0x9E3779B97F4A7C15ULL;
        for (Py_ssize_t k = 0; k < n; k++, c += 0x6A09E667F3BCC90AULL)  /* c stays odd */
            key += w[i + k].hash * c;
        key = mix64(key) & mask;
        size_t slot = (size_t)key & (cap - 1);
        while (table[slot].count &&
               !(table[slot].key == key && same_words(data, width, &w[table[slot].first], &w[i], n)))
            slot = (slot + 1) & (cap - 1);
        if (!table[slot].count++) {
            table[slot].key = key;
            table[slot].first = i;
        }
        slot_of[i] = slot;
    }
    covered = 0;
    for (Py_ssize_t i = 0; i < L; i++) {  /* word i is covered when a repeated n-gram starts in (i - n, i] */
        if (i < m && table[slot_of[i]].count > 1) cover_end = i + n;
        if (i < cover_end) covered += w[i].len;
    }
done:
    free(table);
    free(slot_of);
    return covered;
}

static PyObject *py_duplicate_ngram_chars(PyObject *self, PyObject *args) {
    PyObject *text;
    Py_ssize_t n;
    unsigned long long mask = ~0ULL;
    if (!PyArg_ParseTuple(args, "Un|K", &text, &n, &mask) || ready(text) < 0) return NULL;
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "n-gram size must be >= 1, got %zd", n);
        return NULL;
    }
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t len = PyUnicode_GET_LENGTH(text);
    Word *words = NULL;
    Py_ssize_t L = kind == PyUnicode_1BYTE_KIND   ? find_words(PyUnicode_1BYTE_KIND, data, len, mask, &words)
                   : kind == PyUnicode_2BYTE_KIND ? find_words(PyUnicode_2BYTE_KIND, data, len, mask, &words)
                                                  : find_words(PyUnicode_4BYTE_KIND, data, len, mask, &words);
    if (L < 0) return PyErr_NoMemory();
    Py_ssize_t covered = L < n ? 0 : repeated_chars((const unsigned char *)data, (size_t)kind, words, L, n, mask);
    free(words);
    if (covered < 0) return PyErr_NoMemory();
    return PyLong_FromSsize_t(covered);
}

static PyObject *py_ascii_normalised(PyObject *self, PyObject *args) {
    PyObject *text;
    if (!PyArg_ParseTuple(args, "U", &text) || ready(text) < 0) return NULL;
    if (!PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "ascii_normalised needs an ASCII str");
        return NULL;
    }
    const Py_UCS1 *t = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text), k = 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (!out) return NULL;
    char *o = PyBytes_AS_STRING(out);
    int gap = 0;  /* whitespace seen since the last character written */
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS1 ch = t[i];
        if (ascii_kind[ch] & K_SPACE) {
            gap = k > 0;  /* none at the start */
            continue;
        }
        if (gap) o[k++] = ' ';
        gap = 0;
        o[k++] = (char)(ch >= 'A' && ch <= 'Z' ? ch + 32 : ch);
    }
    if (k < n && _PyBytes_Resize(&out, k) < 0) return NULL;
    return out;
}

static PyMethodDef methods[] = {
    {"text_counts", py_text_counts, METH_VARARGS,
     "text_counts(text, mask=2**64-1) -> (words, non_space, symbols, lines, bullet_lines, ellipsis_lines, "
     "duplicate_lines, alpha)"},
    {"duplicate_ngram_chars", py_duplicate_ngram_chars, METH_VARARGS,
     "duplicate_ngram_chars(text, n, mask=2**64-1) -> characters of the words inside repeated word n-grams"},
    {"ascii_normalised", py_ascii_normalised, METH_VARARGS,
     "ascii_normalised(text) -> bytes: an ASCII text lower-cased, whitespace runs one space, stripped"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_text_fast",
                                    "Native text passes of data preparation (filters' counts, dedup's normalisation).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__text_fast(void) {
    for (Py_UCS4 c = 0; c < 128; c++) {
        ascii_kind[c] = (unsigned char)((Py_UNICODE_ISSPACE(c) ? K_SPACE : 0) | (Py_UNICODE_ISLINEBREAK(c) ? K_BREAK : 0) |
                                        (Py_UNICODE_ISALPHA(c) ? K_ALPHA : 0));
    }
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *b = PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, BULLET_CHARS, (Py_ssize_t)N_BULLETS);
    PyObject *e = Py_BuildValue("(ss)", "...", "\xe2\x80\xa6");  /* UTF-8 of U+2026 */
    int ok = b && e && PyModule_AddObjectRef(m, "BULLETS", b) == 0 && PyModule_AddObjectRef(m, "ELLIPSES", e) == 0;
    Py_XDECREF(b);
    Py_XDECREF(e);
    if (!ok) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
