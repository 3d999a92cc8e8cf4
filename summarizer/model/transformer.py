"""The encoder-decoder Transformer with copy attention: pure math over token ids.

No device, precision or multi-process code lives here: placement, mixed precision and wrapping
are applied from outside (summarizer/runtime/: placement.py, device.py, distributed.py). Shapes
use B = batch, S = source length, T = target length, D = d_model, H = heads, V = vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from summarizer.config.schema import ModelConfig
from summarizer.model.attention import Attention
from summarizer.model.dropout import Dropout

PAD_ID = 0


@dataclass
class DecodeState:
    """Incremental decoding of R = B * group rows: per sentence (B), the source and what the decoder
    derives from its memory once; per row (R), each layer's self-attention keys/values so far."""
    group: int  # rows per sentence (beams); a sentence's rows are consecutive
    src_ids: Tensor  # (B, S)
    src_mask: Tensor  # (B, 1, 1, S)
    memory: Tensor  # (B, S, D)
    memory_kv: list  # per layer: cross-attention (keys, values), each (B, H, S, D/H)
    copy_keys: Tensor | None  # (B, S, D) the copy head's keys
    self_kv: list | None  # per layer: self-attention (keys, values), each (R, H, T, D/H), or None before step 1
    length: int = 0  # positions decoded so far
    # (D, V) the tied output projection, transposed once: at decoding's few rows a contiguous (D, V)
    # operand makes the largest matmul of the step 1.15-1.5x faster than F.linear's (V, D) one.
    output_weight: Tensor | None = None
    # A fixed-size cache (static shapes, summarizer/decode/static.py): self_kv holds `capacity` positions per row
    # from the start, and a step writes its one position `position` ((1,) int64, on the device) in place, so every
    # step has the same shapes and reads no Python int. 0: the cache grows by one position a step.
    capacity: int = 0
    position: Tensor | None = None


class DecoderOutput(NamedTuple):
    logits: Tensor  # (B, T, V) vocabulary scores
    copy_attn: Tensor | None  # (B, T, S) float32 attention over source positions (copy models)
    gate: Tensor | None  # (B, T, 1) float32 probability of generating from the vocabulary


def sinusoidal_positions(n: int, d_model: int) -> Tensor:
    """(n, D) fixed sinusoids (Vaswani et al. 2017, sec. 3.5): no parameters to fit on little data."""
    pos = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n, d_model)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)
    return table


class FeedForward(nn.Sequential):
    # No dropout inside: Vaswani et al. drop only sub-layer outputs and embeddings, and on CPU the
    # (B, N, ffn_dim) mask would be the costliest random draw of the step (measured by `make bench`).
    def __init__(self, cfg: ModelConfig):
        # ReLU in place: one (B, N, ffn_dim) buffer less; its backward needs only the output.
        act = nn.ReLU(inplace=True) if cfg.activation == "relu" else nn.GELU()
        super().__init__(nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias), act,
                         nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias))


def layer_norm(cfg: ModelConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.d_model, bias=cfg.bias)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.norm2 = layer_norm(cfg), layer_norm(cfg)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cfg.bias)
        self.ffn = FeedForward(cfg)
        self.drop = Dropout(cfg.dropout, cfg.fast_dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.norm1(x)  # pre-LN: the residual path stays an identity, so no warm-up tricks are needed
        x = x + self.drop(self.attn(h, *self.attn.project_kv(h), mask=mask))
        return x + self.drop(self.ffn(self.norm2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (layer_norm(cfg) for _ in range(3))
        self.self_attn = Attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cfg.bias)
        self.cross_attn = Attention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cfg.bias)
        self.ffn = FeedForward(cfg)
        self.drop = Dropout(cfg.dropout, cfg.fast_dropout)

    def forward(self, x: Tensor, memory_kv: tuple[Tensor, Tensor], src_mask: Tensor,
                past_kv: tuple[Tensor, Tensor] | None = None, group: int = 1, position: Tensor | None = None,
                self_mask: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """(R, T, D) -> (R, T, D), and this layer's self-attention keys/values so far (the KV cache).

        R = B * group rows: `group` consecutive rows (a sentence's beams) share one source, whose
        memory keys/values (B, H, S, D/H) they query together, as group * T queries: no copies per beam.
        With `position` (a fixed-size cache, T = 1), the new keys/values are written into `past_kv` there and
        the whole cache is attended, `self_mask` (1, 1, 1, capacity) hiding the positions not decoded yet.
        """
        h = self.norm1(x)
        k, v = self.self_attn.project_kv(h)  # (R, H, T_new, D/H)
        if position is not None:
            past_kv[0].index_copy_(2, position, k)
            past_kv[1].index_copy_(2, position, v)
            k, v = past_kv
        elif past_kv is not None:
            k, v = torch.cat([past_kv[0], k], dim=2), torch.cat([past_kv[1], v], dim=2)  # (R, H, T_past + T_new, D/H)
        # Causal masking is needed where the whole prefix is decoded at once (no cache); a cached step decodes one
        # new position, which may see the whole past. Decided by the call, not by a length: with symbolic lengths
        # (train.compile) `x.shape[1] > 1` is a SymBool, which SDPA refuses, so every self-attention broke the graph.
        x = x + self.drop(self.self_attn(h, k, v, mask=self_mask, is_causal=past_kv is None))
        r, t, d = x.shape
        cross = self.cross_attn(self.norm2(x).reshape(r // group, group * t, d), *memory_kv, mask=src_mask)
        x = x + self.drop(cross.reshape(r, t, d))
        return x + self.drop(self.ffn(self.norm3(x))), (k, v)


class Seq2Seq(nn.Module):
    """Pre-LN Transformer encoder-decoder; one embedding for source, target and output projection.

    With `cfg.copy`, a pointer-generator head (See et al. 2017, https://arxiv.org/abs/1704.04368)
    mixes the vocabulary distribution with an attention distribution over the source tokens, so
    rare names and numbers seen in the source can be copied even when the vocabulary barely
    knows them: the strongest inductive bias for headline generation from little data.
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.embedding = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD_ID)
        self.register_buffer("positions", sinusoidal_positions(cfg.max_positions, cfg.d_model), persistent=False)
        self.embed_drop = Dropout(cfg.dropout, cfg.fast_dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.encoder_norm = layer_norm(cfg)
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.decoder_norm = layer_norm(cfg)
        if cfg.copy:
            self.copy_query = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
            self.copy_key = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
            self.copy_gate = nn.Linear(2 * cfg.d_model, 1)
        # None: logits come from the tied embedding. Set only for decoding with another representation of
        # the same weights (an int8 copy: summarizer/decode/quantize.py); never trained, never checkpointed.
        self.vocab_projection: nn.Module | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        # Tied embeddings are scaled by sqrt(D) on input, so start them at std D^-1/2.
        nn.init.normal_(self.embedding.weight, std=self.cfg.d_model ** -0.5)
        with torch.no_grad():
            self.embedding.weight[PAD_ID].zero_()

    # -- encoder ---------------------------------------------------------------------------
    def embed(self, ids: Tensor, offset: int | Tensor = 0) -> Tensor:
        """(B, N) ids -> (B, N, D) scaled embeddings plus positions offset..offset+N (an (N,) tensor of
        positions: those)."""
        x = self.embedding(ids) * math.sqrt(self.cfg.d_model)
        if isinstance(offset, Tensor):
            positions = self.positions.index_select(0, offset)
        else:
            positions = self.positions[offset:offset + ids.shape[1]]
        return self.embed_drop(x + positions.to(x.dtype))

    @staticmethod
    def source_mask(src_ids: Tensor) -> Tensor:
        """(B, S) ids -> (B, 1, 1, S) bool, True where attention is allowed (real tokens)."""
        return (src_ids != PAD_ID)[:, None, None, :]

    def run_encoder(self, x: Tensor, src_mask: Tensor) -> Tensor:
        """(B, S, D) embedded source -> (B, S, D) memory. Split from `embed` so placement can hop devices."""
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def encode(self, src_ids: Tensor) -> Tensor:
        return self.run_encoder(self.embed(src_ids), self.source_mask(src_ids))

    # -- decoder ---------------------------------------------------------------------------
    def start_decoding(self, memory: Tensor, src_ids: Tensor, group: int = 1, capacity: int = 0) -> DecodeState:
        """What incremental decoding of `group` rows per source keeps: everything computed from the
        memory once per sentence (cross-attention keys/values, the copy head's keys), nothing per row yet;
        with `capacity`, a fixed-size cache of that many positions per row, zeros until written."""
        state = self._memory_state(memory, src_ids, group)
        # Contiguous once, rather than copied by attention's reshape at every step.
        state.memory_kv = [(k.contiguous(), v.contiguous()) for k, v in state.memory_kv]
        state.self_kv = [None] * len(self.decoder_layers)
        if capacity:
            b, h, _, head = state.memory_kv[0][0].shape
            state.self_kv = [tuple(state.memory_kv[0][0].new_zeros(b * group, h, capacity, head) for _ in range(2))
                             for _ in self.decoder_layers]
            state.capacity, state.position = capacity, torch.zeros(1, dtype=torch.long, device=memory.device)
        if self.vocab_projection is None:  # stored as the decoder's linear layers are (quantize.decoding_form)
            dtype = self.decoder_layers[0].self_attn.q_proj.weight.dtype
            state.output_weight = self.embedding.weight.t().to(dtype).contiguous()
        return state

    def _memory_state(self, memory: Tensor, src_ids: Tensor, group: int = 1) -> DecodeState:
        return DecodeState(
            group=group, src_ids=src_ids, src_mask=self.source_mask(src_ids), memory=memory,
            memory_kv=[layer.cross_attn.project_kv(memory) for layer in self.decoder_layers],
            copy_keys=self.copy_key(memory) if self.cfg.copy else None, self_kv=None)

    def decoder_output(self, tgt_in: Tensor, memory: Tensor, src_ids: Tensor,
                       state: DecodeState | None = None) -> DecoderOutput:
        """(R, T) target prefix ids -> vocabulary logits and, with copy, copy attention and gate.

        Without `state`, R = B and the whole prefix is decoded (training). With a `state` from
        `start_decoding`, only the new positions of `tgt_in` are fed, past keys/values are reused
        and extended (incremental decoding in O(T) per step), and R = B * state.group.
        """
        if state is None:
            state = self._memory_state(memory, src_ids)  # the whole prefix at once: no cache to keep
        group, past, position, self_mask = state.group, state.length, state.position, None
        if position is not None:  # one position of a fixed-size cache: the positions up to it are seen
            self_mask = (torch.arange(state.capacity, device=position.device) <= position)[None, None, None, :]
        x = self.embed(tgt_in, offset=past if position is None else position)  # (R, T, D)
        for i, layer in enumerate(self.decoder_layers):
            x, kv = layer(x, state.memory_kv[i], state.src_mask, state.self_kv and state.self_kv[i], group, position,
                          self_mask)
            if state.self_kv is not None:
                state.self_kv[i] = kv
        state.length = past + tgt_in.shape[1]
        h = self.decoder_norm(x)  # (R, T, D)
        r, t, d = h.shape
        if self.vocab_projection is not None:  # (R, T, V), the tied output projection
            logits = self.vocab_projection(h.reshape(r * t, d)).reshape(r, t, -1)
        elif state.output_weight is not None:
            logits = h @ state.output_weight
        else:
            logits = F.linear(h, self.embedding.weight)
        if not self.cfg.copy:
            return DecoderOutput(logits, None, None)
        queries = self.copy_query(h).reshape(r // group, group * t, d)  # a sentence's rows together
        scores = (queries @ state.copy_keys.transpose(1, 2)).float() / math.sqrt(self.cfg.d_model)  # (B, G*T, S)
        attn = scores.masked_fill(~state.src_mask[:, 0], float("-inf")).softmax(dim=-1)
        context = (attn.to(state.memory.dtype) @ state.memory).reshape(r, t, d)  # (R, T, D)
        gate = torch.sigmoid(self.copy_gate(torch.cat([h, context], dim=-1)).float())  # (R, T, 1)
        return DecoderOutput(logits, attn.reshape(r, t, -1), gate)

    @staticmethod
    def log_probs(out: DecoderOutput, src_ids: Tensor, group: int = 1) -> Tensor:
        """(R, T, V) float32 log p(w) = log(g * p_vocab(w) + (1 - g) * sum_{s: src_s = w} attn_s), for the
        (B, S) source ids of R = B * group rows (a sentence's rows consecutive).

        In log space: log g + log_softmax(logits) is right for every word not in the source, so only the
        source's ids (at most S per row) are corrected, and the (R, T, V) tensor is written twice, not
        six times. Decoding needs this at one position per step; training never materialises it (losses.py).
        """
        log_probs = out.logits.float().log_softmax(dim=-1)
        if out.copy_attn is None:
            return log_probs
        r, t, s = out.copy_attn.shape
        same = (src_ids[:, :, None] == src_ids[:, None, :]).float()  # (B, S, S): positions holding one id
        # Copy mass of each position's id, its other occurrences included: (R, T, S).
        mass = (out.copy_attn.reshape(r // group, group * t, s) @ same).reshape(r, t, s).mul_(1.0 - out.gate)
        index = src_ids[:, None, None, :].expand(r // group, group, t, s).reshape(r, t, s)  # (R, T, S), no host sync
        log_probs.add_(out.gate.log())
        return log_probs.scatter_(2, index, torch.logaddexp(log_probs.gather(2, index), mass.log()))

    def decode(self, tgt_in: Tensor, memory: Tensor, src_ids: Tensor, state: DecodeState | None = None) -> Tensor:
        """(R, T) target prefix ids -> (R, T, V) float32 log-probabilities (the decoding interface)."""
        out = self.decoder_output(tgt_in, memory, src_ids, state)
        return self.log_probs(out, state.src_ids if state is not None else src_ids,
                              state.group if state is not None else 1)

    def forward(self, src_ids: Tensor, tgt_in: Tensor) -> DecoderOutput:
        """(B, S) source ids, (B, T) target prefix ids -> logits (B, T, V) [+ copy attention, gate]."""
        return self.decoder_output(tgt_in, self.encode(src_ids), src_ids)

    @staticmethod
    def reorder(state: DecodeState, rows: Tensor, group: int | None = None) -> None:
        """Beam search: row i continues the hypothesis of row rows[i] (of the same sentence); `group` rows
        per sentence from now on if given (the first step widens one row per sentence to the beam). A fixed-size
        cache is reordered in place."""
        state.group = group or state.group
        if state.capacity:
            for k, v in state.self_kv:
                k.copy_(k.index_select(0, rows))
                v.copy_(v.index_select(0, rows))
            return
        state.self_kv = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in state.self_kv]

    @staticmethod
    def keep_sentences(state: DecodeState, keep: Tensor) -> None:
        """Drop finished sentences: keep the (B',) sentence indices `keep`, their memory and their rows."""
        rows = (keep[:, None] * state.group + torch.arange(state.group, device=keep.device)).reshape(-1)
        state.src_ids, state.src_mask, state.memory = (t.index_select(0, keep) for t in
                                                       (state.src_ids, state.src_mask, state.memory))
        state.memory_kv = [(k.index_select(0, keep), v.index_select(0, keep)) for k, v in state.memory_kv]
        if state.copy_keys is not None:
            state.copy_keys = state.copy_keys.index_select(0, keep)
        state.self_kv = [kv if kv is None else (kv[0].index_select(0, rows), kv[1].index_select(0, rows))
                         for kv in state.self_kv]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
