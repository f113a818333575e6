"""text <-> ids: the byte-level BPE Tokenizer (core.py), its split patterns and special tokens
(patterns.py), its file formats (formats.py), learning merges (bpe.py) and counting pre-tokens
over a corpus on all cores (pretokenize.py); SentencePiece-style BPE with byte fallback
(sentencepiece.py, with sp_bpe.py, sp_pipeline.py and sp_files.py). Nothing here knows the model."""

from logitlab.tokenizer.bpe import BPEConfig, ShortVocabularyWarning, train_bpe, train_tokenizer
from logitlab.tokenizer.core import Tokenizer
from logitlab.tokenizer.patterns import CL100K_PATTERN, GPT2_PATTERN, PATTERNS, resolve_pattern
from logitlab.tokenizer.sentencepiece import SentencePieceTokenizer
from logitlab.tokenizer.sp_pipeline import SentencePieceConfig

__all__ = ["BPEConfig", "CL100K_PATTERN", "GPT2_PATTERN", "PATTERNS", "SentencePieceConfig", "SentencePieceTokenizer",
           "ShortVocabularyWarning", "Tokenizer", "resolve_pattern", "train_bpe", "train_tokenizer"]
