/* Native BPE merge loop: the same algorithm, rule and results as bpe.learn_merges_python.
 *
 * learn_merges(words, freqs, n_merges, first_id, progress) -> list of (bytes, bytes)
 *   words: list of bytes (distinct pre-tokens, each longer than one byte), freqs: list of int.
 *
 * Data layout: every word is a run of int32 token ids in one arena (merging only shrinks a word,
 * so it is rewritten in place). Pairs live in an open-addressing table keyed by (left << 32 | right);
 * each pair has its count and an index of the words that may hold it (stale entries allowed; a word
 * that lost the pair is skipped). The best pair comes from a binary max-heap with lazy deletion:
 * an entry whose count is stale is pushed back with the current count. Order: higher count first,
 * then the lexicographically greater (bytes(left), bytes(right)).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { int32_t *v; int32_t n, cap; } IdVec;
typedef struct { uint64_t key; int64_t count; IdVec where; int32_t mark; } Pair;
typedef struct { int64_t count; uint32_t a, b; } Entry;
typedef struct { unsigned char *p; Py_ssize_t n; } Tok;

typedef struct {
    int64_t *slots;  /* pair index + 1, 0 = empty */
    size_t mask;
    Pair *pairs;
    size_t n_pairs, cap_pairs;
    Entry *heap;
    size_t n_heap, cap_heap;
    Tok *toks;
    size_t n_toks, cap_toks;
} State;

static int vec_push(IdVec *v, int32_t x) {
    if (v->n == v->cap) {
        int32_t cap = v->cap ? v->cap * 2 : 2;
        int32_t *nv = (int32_t *)realloc(v->v, sizeof(int32_t) * (size_t)cap);
        if (!nv) return -1;
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = x;
    return 0;
}

static inline uint64_t hash64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}

static int table_grow(State *s) {
    size_t cap = (s->mask + 1) * 2;
    int64_t *slots = (int64_t *)calloc(cap, sizeof(int64_t));
    if (!slots) return -1;
    for (size_t i = 0; i < s->n_pairs; i++) {
        size_t h = hash64(s->pairs[i].key) & (cap - 1);
        while (slots[h]) h = (h + 1) & (cap - 1);
        slots[h] = (int64_t)i + 1;
    }
    free(s->slots);
    s->slots = slots;
    s->mask = cap - 1;
    return 0;
}

/* The pair for key, created with count 0 when absent (NULL on memory error). */
static Pair *pair_get(State *s, uint64_t key, int create) {
    size_t h = hash64(key) & s->mask;
    while (s->slots[h]) {
        Pair *p = &s->pairs[s->slots[h] - 1];
        if (p->key == key) return p;
        h = (h + 1) & s->mask;
    }
    if (!create) return NULL;
    if (s->n_pairs == s->cap_pairs) {
        size_t cap = s->cap_pairs * 2;
        Pair *np = (Pair *)realloc(s->pairs, sizeof(Pair) * cap);
        if (!np) return NULL;
        s->pairs = np;
        s->cap_pairs = cap;
    }
    Pair *p = &s->pairs[s->n_pairs];
    p->key = key;
    p->count = 0;
    p->where.v = NULL;
    p->where.n = p->where.cap = 0;
    p->mark = -1;
    s->slots[h] = (int64_t)++s->n_pairs;
    if (s->n_pairs * 2 > s->mask + 1 && table_grow(s) < 0) return NULL;
    return &s->pairs[s->n_pairs - 1];
}

static inline int bytes_cmp(const Tok *x, const Tok *y) {
    Py_ssize_t n = x->n < y->n ? x->n : y->n;
    int c = memcmp(x->p, y->p, (size_t)n);
    if (c) return c;
    return (x->n > y->n) - (x->n < y->n);
}

/* > 0 when entry x ranks before y (pops first). */
static inline int entry_cmp(const State *s, const Entry *x, const Entry *y) {
    if (x->count != y->count) return x->count > y->count ? 1 : -1;
    int c = bytes_cmp(&s->toks[x->a], &s->toks[y->a]);
    if (c) return c;
    return bytes_cmp(&s->toks[x->b], &s->toks[y->b]);
}

static int heap_push(State *s, int64_t count, uint32_t a, uint32_t b) {
    if (s->n_heap == s->cap_heap) {
        size_t cap = s->cap_heap ? s->cap_heap * 2 : 1024;
        Entry *nh = (Entry *)realloc(s->heap, sizeof(Entry) * cap);
        if (!nh) return -1;
        s->heap = nh;
        s->cap_heap = cap;
    }
    Entry e = {count, a, b};
    size_t i = s->n_heap++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (entry_cmp(s, &e, &s->heap[up]) <= 0) break;
        s->heap[i] = s->heap[up];
        i = up;
    }
    s->heap[i] = e;
    return 0;
}

static Entry heap_pop(State *s) {
    Entry top = s->heap[0];
    Entry last = s->heap[--s->n_heap];
    size_t n = s->n_heap, i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && entry_cmp(s, &s->heap[c + 1], &s->heap[c]) > 0) c++;
        if (entry_cmp(s, &s->heap[c], &last) <= 0) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n) s->heap[i] = last;
    return top;
}

static int tok_add(State *s, const unsigned char *p, Py_ssize_t n) {
    if (s->n_toks == s->cap_toks) {
        size_t cap = s->cap_toks * 2;
        Tok *nt = (Tok *)realloc(s->toks, sizeof(Tok) * cap);
        if (!nt) return -1;
        s->toks = nt;
        s->cap_toks = cap;
    }
    unsigned char *copy = (unsigned char *)malloc((size_t)(n ? n : 1));
    if (!copy) return -1;
    memcpy(copy, p, (size_t)n);
    s->toks[s->n_toks].p = copy;
    s->toks[s->n_toks].n = n;
    s->n_toks++;
    return 0;
}

static void state_free(State *s) {
    for (size_t i = 0; i < s->n_pairs; i++) free(s->pairs[i].where.v);
    for (size_t i = 0; i < s->n_toks; i++) free(s->toks[i].p);
    free(s->slots); free(s->pairs); free(s->heap); free(s->toks);
}

#define KEY(a, b) (((uint64_t)(uint32_t)(a) << 32) | (uint32_t)(b))

/* count[key] += delta; when delta > 0 also index word wi and remember key once per merge in `fresh`. */
static int bump(State *s, uint64_t key, int64_t delta, int32_t wi, IdVec *fresh, int32_t step) {
    Pair *p = pair_get(s, key, 1);
    if (!p) return -1;
    p->count += delta;
    if (delta < 0) return 0;
    if (p->mark != step) {
        p->mark = step;
        if (vec_push(fresh, (int32_t)(p - s->pairs)) < 0) return -1;
    }
    if (p->where.n == 0 || p->where.v[p->where.n - 1] != wi) return vec_push(&p->where, wi);
    return 0;
}

typedef struct { int32_t *ids; int64_t *start; int32_t *len; int64_t *freq; Py_ssize_t n; } Words;

/* Merge (a, b) -> nw in the listed words (`where` is taken over by the caller). */
static int apply_merge(State *s, Words *w, int32_t a, int32_t b, int32_t nw, const IdVec *where, IdVec *fresh,
                       int32_t step) {
    for (int32_t k = 0; k < where->n; k++) {
        int32_t wi = where->v[k];
        int32_t *word = w->ids + w->start[wi];
        int32_t n = w->len[wi], out = 0, j = 0;
        int64_t f = w->freq[wi];
        int merged = 0;
        while (j < n) {
            if (j + 1 < n && word[j] == a && word[j + 1] == b) {
                if (out > 0) {
                    int32_t left = word[out - 1];
                    if (bump(s, KEY(left, a), -f, wi, fresh, step) < 0 || bump(s, KEY(left, nw), f, wi, fresh, step) < 0)
                        return -1;
                }
                if (j + 2 < n) {
                    int32_t right = word[j + 2];
                    if (bump(s, KEY(b, right), -f, wi, fresh, step) < 0 || bump(s, KEY(nw, right), f, wi, fresh, step) < 0)
                        return -1;
                }
                word[out++] = nw;
                j += 2;
                merged = 1;
            } else {
                word[out++] = word[j++];
            }
        }
        if (merged) w->len[wi] = out;
    }
    return 0;
}

static int words_load(Words *w, PyObject *words, PyObject *freqs) {
    Py_ssize_t n = PyList_GET_SIZE(words), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(words, i);
        if (!PyBytes_Check(x)) { PyErr_SetString(PyExc_TypeError, "words must be bytes"); return -1; }
        total += PyBytes_GET_SIZE(x);
    }
    w->n = n;
    w->ids = (int32_t *)malloc(sizeof(int32_t) * (size_t)(total ? total : 1));
    w->start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    w->len = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    w->freq = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    if (!w->ids || !w->start || !w->len || !w->freq) { PyErr_NoMemory(); return -1; }
    int64_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(words, i);
        const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(x);
        Py_ssize_t len = PyBytes_GET_SIZE(x);
        if (len > INT32_MAX) { PyErr_SetString(PyExc_ValueError, "word too long"); return -1; }
        w->start[i] = at;
        w->len[i] = (int32_t)len;
        for (Py_ssize_t j = 0; j < len; j++) w->ids[at++] = p[j];
        long long f = PyLong_AsLongLong(PyList_GET_ITEM(freqs, i));
        if (f == -1 && PyErr_Occurred()) return -1;
        w->freq[i] = f;
    }
    return 0;
}

static int state_init(State *s, Words *w) {
    memset(s, 0, sizeof(*s));
    s->mask = (1 << 16) - 1;
    s->slots = (int64_t *)calloc(s->mask + 1, sizeof(int64_t));
    s->cap_pairs = 1 << 15;
    s->pairs = (Pair *)malloc(sizeof(Pair) * s->cap_pairs);
    s->cap_toks = 1024;
    s->toks = (Tok *)malloc(sizeof(Tok) * s->cap_toks);
    if (!s->slots || !s->pairs || !s->toks) return -1;
    for (int i = 0; i < 256; i++) {
        unsigned char c = (unsigned char)i;
        if (tok_add(s, &c, 1) < 0) return -1;
    }
    for (Py_ssize_t wi = 0; wi < w->n; wi++) {
        const int32_t *word = w->ids + w->start[wi];
        for (int32_t j = 0; j + 1 < w->len[wi]; j++) {
            Pair *p = pair_get(s, KEY(word[j], word[j + 1]), 1);
            if (!p) return -1;
            p->count += w->freq[wi];
            if ((p->where.n == 0 || p->where.v[p->where.n - 1] != (int32_t)wi) && vec_push(&p->where, (int32_t)wi) < 0)
                return -1;
        }
    }
    for (size_t i = 0; i < s->n_pairs; i++)
        if (heap_push(s, s->pairs[i].count, (uint32_t)(s->pairs[i].key >> 32), (uint32_t)s->pairs[i].key) < 0) return -1;
    return 0;
}

/* Id of a token with these bytes, or -1 (linear probe over a small hash of token bytes). */
typedef struct { int32_t *slots; size_t mask; } TokIndex;

static uint64_t bytes_hash(const unsigned char *p, Py_ssize_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (Py_ssize_t i = 0; i < n; i++) { h ^= p[i]; h *= 1099511628211ULL; }
    return hash64(h);
}

static int32_t tok_find(State *s, TokIndex *ix, const unsigned char *p, Py_ssize_t n) {
    size_t h = bytes_hash(p, n) & ix->mask;
    while (ix->slots[h] >= 0) {
        Tok *t = &s->toks[ix->slots[h]];
        if (t->n == n && memcmp(t->p, p, (size_t)n) == 0) return ix->slots[h];
        h = (h + 1) & ix->mask;
    }
    return -1;
}

static void tok_index(State *s, TokIndex *ix, int32_t id) {
    size_t h = bytes_hash(s->toks[id].p, s->toks[id].n) & ix->mask;
    while (ix->slots[h] >= 0) h = (h + 1) & ix->mask;
    ix->slots[h] = id;
}

static PyObject *learn(State *s, Words *w, Py_ssize_t n_merges, long first_id, PyObject *progress) {
    size_t cap = 1024;
    while (cap < 4 * (size_t)(256 + n_merges)) cap *= 2;
    TokIndex ix = {(int32_t *)malloc(sizeof(int32_t) * cap), cap - 1};
    unsigned char *buf = NULL;
    PyObject *merges = PyList_New(0);
    IdVec fresh = {NULL, 0, 0};
    if (!ix.slots || !merges) goto fail;
    for (size_t i = 0; i < cap; i++) ix.slots[i] = -1;
    for (int32_t i = 0; i < 256; i++) tok_index(s, &ix, i);
    long next_id = first_id;
    int32_t step = 0;
    while (next_id < first_id + n_merges && s->n_heap) {
        Entry e = heap_pop(s);
        Pair *p = pair_get(s, KEY(e.a, e.b), 0);
        int64_t c = p ? p->count : 0;
        if (c != e.count) {
            if (c > 0 && heap_push(s, c, e.a, e.b) < 0) goto nomem;
            continue;
        }
        Tok *ta = &s->toks[e.a], *tb = &s->toks[e.b];
        Py_ssize_t n = ta->n + tb->n;
        buf = (unsigned char *)malloc((size_t)n);
        if (!buf) goto nomem;
        memcpy(buf, ta->p, (size_t)ta->n);
        memcpy(buf + ta->n, tb->p, (size_t)tb->n);
        PyObject *pair = Py_BuildValue("(y#y#)", ta->p, ta->n, tb->p, tb->n);
        if (!pair || PyList_Append(merges, pair) < 0) { Py_XDECREF(pair); goto fail; }
        Py_DECREF(pair);
        int32_t nw = tok_find(s, &ix, buf, n);
        if (nw < 0) {
            nw = (int32_t)s->n_toks;
            next_id++;
            if (tok_add(s, buf, n) < 0) goto nomem;
            tok_index(s, &ix, nw);
        }
        free(buf);
        buf = NULL;
        IdVec where = p->where;  /* taken over: the pair is gone after this merge */
        p->where.v = NULL;
        p->where.n = p->where.cap = 0;
        fresh.n = 0;
        int rc = apply_merge(s, w, (int32_t)e.a, (int32_t)e.b, nw, &where, &fresh, step++);
        free(where.v);
        if (rc < 0) goto nomem;
        p = pair_get(s, KEY(e.a, e.b), 0);  /* the table may have moved */
        p->count = 0;
        for (int32_t i = 0; i < fresh.n; i++) {
            Pair *q = &s->pairs[fresh.v[i]];
            if (q->count > 0 && heap_push(s, q->count, (uint32_t)(q->key >> 32), (uint32_t)q->key) < 0) goto nomem;
        }
        if (progress != Py_None) {
            PyObject *r = PyObject_CallFunction(progress, "i", 1);
            if (!r) goto fail;
            Py_DECREF(r);
        }
    }
    free(ix.slots);
    free(fresh.v);
    return merges;
nomem:
    PyErr_NoMemory();
fail:
    free(buf);
    free(ix.slots);
    free(fresh.v);
    Py_XDECREF(merges);
    return NULL;
}

static PyObject *py_learn_merges(PyObject *self, PyObject *args) {
    PyObject *words, *freqs, *progress = Py_None;
    Py_ssize_t n_merges;
    long first_id;
    if (!PyArg_ParseTuple(args, "O!O!nl|O", &PyList_Type, &words, &PyList_Type, &freqs, &n_merges, &first_id,
                          &progress))
        return NULL;
    if (PyList_GET_SIZE(words) != PyList_GET_SIZE(freqs)) {
        PyErr_SetString(PyExc_ValueError, "words and freqs must have the same length");
        return NULL;
    }
    if (n_merges < 0 || n_merges > (1 << 24)) {
        PyErr_Format(PyExc_ValueError, "n_merges (%zd) must be in [0, 2**24]", n_merges);
        return NULL;
    }
    Words w = {0};
    State s;
    PyObject *out = NULL;
    memset(&s, 0, sizeof(s));
    if (words_load(&w, words, freqs) < 0) goto done;
    if (state_init(&s, &w) < 0) { PyErr_NoMemory(); goto done; }
    out = learn(&s, &w, n_merges, first_id, progress);
done:
    state_free(&s);
    free(w.ids); free(w.start); free(w.len); free(w.freq);
    return out;
}

/* ---------------------------------------------------------------- pre-tokens of ASCII text
 * count_ascii_gpt2(text, counts): split pure-ASCII `text` exactly as the GPT-2 pattern does and add
 * each piece's count to the dict `counts` (str -> int). On ASCII, \p{L} is [A-Za-z], \p{N} is [0-9]
 * and \s is [\t\n\v\f\r ] (the `regex` module's White_Space); everything else is "other".
 *   's|'t|'re|'ve|'m|'ll|'d | ?L+ | ?N+ | ?O+ | \s+(?!\S) | \s+
 */
enum { C_OTHER = 0, C_LETTER = 1, C_DIGIT = 2, C_SPACE = 3 };
static unsigned char ascii_class[128];

static Py_ssize_t gpt2_piece(const unsigned char *t, Py_ssize_t i, Py_ssize_t n) {
    unsigned char c = t[i];
    if (c == '\'' && i + 1 < n) {
        unsigned char d = t[i + 1];
        if (d == 's' || d == 't' || d == 'm' || d == 'd') return 2;
        if (i + 2 < n) {
            unsigned char e = t[i + 2];
            if ((d == 'r' && e == 'e') || (d == 'v' && e == 'e') || (d == 'l' && e == 'l')) return 3;
        }
    }
    Py_ssize_t j = i;
    int k = ascii_class[c];
    if (c == ' ' && i + 1 < n && ascii_class[t[i + 1]] != C_SPACE) {
        j = i + 1;
        k = ascii_class[t[j]];
    }
    if (k != C_SPACE) {  /* ` ?L+`, ` ?N+` or ` ?O+`: one class, greedy */
        while (j < n && ascii_class[t[j]] == k) j++;
        return j - i;
    }
    while (j < n && ascii_class[t[j]] == C_SPACE) j++;
    Py_ssize_t run = j - i;
    if (j == n || run == 1) return run;  /* at the end, or a single space before non-space */
    return run - 1;                      /* leave the last one to start the next piece */
}

typedef struct { Py_ssize_t at, len; int64_t count; } Span;

static PyObject *py_count_ascii_gpt2(PyObject *self, PyObject *args) {
    PyObject *text, *counts;
    if (!PyArg_ParseTuple(args, "UO!", &text, &PyDict_Type, &counts)) return NULL;
    if (!PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "count_ascii_gpt2 needs pure-ASCII text");
        return NULL;
    }
    const unsigned char *t = (const unsigned char *)PyUnicode_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    size_t cap = 1024;
    while (cap < (size_t)n / 4 + 16) cap *= 2;
    if (cap > (1u << 22)) cap = 1u << 22;
    size_t mask = cap - 1, used = 0;
    Span *tab = (Span *)calloc(cap, sizeof(Span));
    if (!tab) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t len = gpt2_piece(t, i, n);
        uint64_t h = bytes_hash(t + i, len);
        size_t slot = h & mask;
        while (tab[slot].len && !(tab[slot].len == len && memcmp(t + tab[slot].at, t + i, (size_t)len) == 0))
            slot = (slot + 1) & mask;
        if (!tab[slot].len) {
            tab[slot].at = i;
            tab[slot].len = len;
            if (++used * 2 > cap) {  /* grow */
                size_t ncap = cap * 2;
                Span *nt = (Span *)calloc(ncap, sizeof(Span));
                if (!nt) { free(tab); return PyErr_NoMemory(); }
                for (size_t q = 0; q < cap; q++) {
                    if (!tab[q].len) continue;
                    size_t s2 = bytes_hash(t + tab[q].at, tab[q].len) & (ncap - 1);
                    while (nt[s2].len) s2 = (s2 + 1) & (ncap - 1);
                    nt[s2] = tab[q];
                    if (tab[q].at == i && tab[q].len == len) slot = s2;
                }
                free(tab);
                tab = nt;
                cap = ncap;
                mask = cap - 1;
            }
        }
        tab[slot].count++;
        i += len;
    }
    int ok = 1;
    for (size_t q = 0; q < cap && ok; q++) {
        if (!tab[q].len) continue;
        PyObject *key = PyUnicode_FromStringAndSize((const char *)t + tab[q].at, tab[q].len);
        PyObject *old = key ? PyDict_GetItemWithError(counts, key) : NULL;
        PyObject *add = NULL, *sum = NULL;
        if (!key || (!old && PyErr_Occurred())) ok = 0;
        else if (!(add = PyLong_FromLongLong(tab[q].count))) ok = 0;
        else if (!(sum = old ? PyNumber_Add(old, add) : (Py_INCREF(add), add))) ok = 0;
        else if (PyDict_SetItem(counts, key, sum) < 0) ok = 0;
        Py_XDECREF(key); Py_XDECREF(add); Py_XDECREF(sum);
    }
    free(tab);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"learn_merges", py_learn_merges, METH_VARARGS,
     "learn_merges(words, freqs, n_merges, first_id, progress=None) -> list of (bytes, bytes)"},
    {"count_ascii_gpt2", py_count_ascii_gpt2, METH_VARARGS,
     "count_ascii_gpt2(text, counts): add the GPT-2 pre-tokens of pure-ASCII text to a dict"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bpe_fast", "Native BPE merge loop.", -1, methods};

PyMODINIT_FUNC PyInit__bpe_fast(void) {
    for (int c = 0; c < 128; c++) {
        ascii_class[c] = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ? C_LETTER
                         : (c >= '0' && c <= '9') ? C_DIGIT
                         : (c == ' ' || (c >= 9 && c <= 13)) ? C_SPACE : C_OTHER;
    }
    return PyModule_Create(&module);
}
