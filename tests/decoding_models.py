"""What the decoding tests decode with: the plain settings, a sharpened random model, and, for the word rules,
a random model over the tiny corpus' real tokenizer and a Lexicon of a third of its training words."""
import dataclasses

import torch

from summarizer.config.schema import EvalConfig, ModelConfig
from summarizer.data.prepared import open_tokenizer, training_words
from summarizer.decode.lexicon import Lexicon
from summarizer.model.transformer import Seq2Seq

PLAIN = EvalConfig(max_len=12, known_words=False, no_repeat_words=False, no_repeat_ngram=0)


def settings(**kw) -> EvalConfig:
    return dataclasses.replace(PLAIN, **kw)


def sharp_model() -> Seq2Seq:
    """A random model over 40 pieces, its embeddings sharpened: varied, non-trivial outputs."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=2, ffn_dim=64, dropout=0.0)
    m = Seq2Seq(cfg, 40).eval()
    with torch.no_grad():
        m.embedding.weight.mul_(4.0)
    return m


def ragged_sources(rows: int) -> torch.Tensor:
    """(rows, 9) source ids of sharp_model's vocabulary, seeded; rows 1, 3 and 5 (where present) padded after 6, 4
    and 2 tokens, so a batch holds sources of several lengths."""
    torch.manual_seed(1)
    src = torch.randint(4, 40, (rows, 9))
    for row, length in ((1, 6), (3, 4), (5, 2)):
        if row < rows:
            src[row, length:] = 0
    return src


def word_rules_model(data_dir) -> tuple:
    """(tokenizer, known words, Lexicon of them, model): a random model that would happily invent words."""
    tokenizer = open_tokenizer(data_dir)
    known = set(sorted(training_words(data_dir))[::3])  # a third of the training words
    torch.manual_seed(5)
    m = Seq2Seq(ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64, dropout=0.0),
                tokenizer.vocab_size).eval()
    with torch.no_grad():
        m.embedding.weight.mul_(3.0)
    return tokenizer, known, Lexicon(tokenizer, known), m


def padded(tokenizer, texts: list[str]) -> torch.Tensor:
    """(B, S) the texts' ids, padded."""
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(tokenizer.encode(t)) for t in texts], batch_first=True)
