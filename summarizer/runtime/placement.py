"""Model-parallel placement: encoder on one device, embedding and decoder on another, behind the model's interface."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from summarizer.runtime import Runtime, move


class PlacedSeq2Seq(nn.Module):
    """Model parallel: encoder layers on one device, embedding and decoder on another.

    It takes inputs wherever they are and reads like the plain model: `forward` returns the
    decoder's outputs on the decoder device (where the loss then runs), `decode` returns
    log-probabilities on the device its inputs came from, and its state dict is the inner model's.
    So the loop, the loss and the decoders need not know the model is split.

    The one shared embedding (source, target and output projection) lives with the decoder, where
    two of its three uses are: source ids are embedded there and the embeddings hop to the encoder
    device, so a single Parameter gets every gradient and no copy has to be kept in sync. The
    memory hops back for cross-attention. Autograd carries gradients across `.to()` both ways.
    With `chunks > 1` the batch is split in micro-batches and, because CUDA launches are
    asynchronous, the encoder of chunk i+1 runs while the decoder of chunk i does (GPipe-style).
    """

    def __init__(self, model: nn.Module, encoder_device: torch.device, decoder_device: torch.device,
                 chunks: int = 1):
        super().__init__()
        self.inner, self.enc_dev, self.dec_dev, self.chunks = model, encoder_device, decoder_device, chunks
        model.to(decoder_device)
        model.encoder_layers.to(encoder_device)
        model.encoder_norm.to(encoder_device)
        # Its state dict is the inner model's keys, also inside a module that holds it (the moving average), which
        # saves through each child's state_dict but loads through _load_from_state_dict: hooks serve both ways.
        self.register_state_dict_post_hook(_without_inner)
        self.register_load_state_dict_pre_hook(_with_inner)

    def _embedded(self, src_ids: Tensor) -> Tensor:
        """(B, S, D) source embeddings, made on the decoder device (the embedding's), on the encoder device."""
        return move(self.inner.embed(move(src_ids, self.dec_dev)), self.enc_dev)

    def _encoded(self, x: Tensor, src_ids: Tensor) -> Tensor:
        """The memory, on the encoder device."""
        return self.inner.run_encoder(x, self.inner.source_mask(move(src_ids, self.enc_dev)))

    def encode(self, src_ids: Tensor) -> Tensor:
        return move(self._encoded(self._embedded(src_ids), src_ids), self.dec_dev)

    def decoder_output(self, tgt_in: Tensor, memory: Tensor, src_ids: Tensor, state=None):
        return self.inner.decoder_output(move(tgt_in, self.dec_dev), move(memory, self.dec_dev),
                                         move(src_ids, self.dec_dev), state)

    def start_decoding(self, memory: Tensor, src_ids: Tensor, group: int = 1, capacity: int = 0):
        return self.inner.start_decoding(move(memory, self.dec_dev), move(src_ids, self.dec_dev), group, capacity)

    def decode(self, tgt_in: Tensor, memory: Tensor, src_ids: Tensor, state=None) -> Tensor:
        log_probs = self.inner.decode(move(tgt_in, self.dec_dev), move(memory, self.dec_dev),
                                      move(src_ids, self.dec_dev), state)
        return log_probs.to(tgt_in.device)

    def reorder(self, state, rows: Tensor, group: int | None = None) -> None:
        self.inner.reorder(state, move(rows, self.dec_dev), group)

    def keep_sentences(self, state, keep: Tensor) -> None:
        self.inner.keep_sentences(state, move(keep, self.dec_dev))

    def forward(self, src_ids: Tensor, tgt_in: Tensor):
        if self.chunks <= 1:
            return self.decoder_output(tgt_in, self.encode(src_ids), src_ids)
        # The order work is queued in is what lets the two GPUs overlap: a copy between them makes each device's
        # stream wait for all the other has queued so far (torch's copy_device_to_device: a two-way barrier). So
        # every chunk is embedded and sent to the encoder first; then encoder chunk i+1 is queued, then decoder
        # chunk i, and only then does chunk i+1's memory hop to the decoder device. Hopping it before decoder
        # chunk i was queued made that chunk wait for encoder chunk i+1: the chunks ran one after another.
        src_chunks, tgt_chunks = src_ids.chunk(self.chunks), tgt_in.chunk(self.chunks)
        embedded = [self._embedded(chunk) for chunk in src_chunks]
        memory, outputs = move(self._encoded(embedded[0], src_chunks[0]), self.dec_dev), []
        for i in range(len(src_chunks)):
            following = self._encoded(embedded[i + 1], src_chunks[i + 1]) if i + 1 < len(src_chunks) else None
            outputs.append(self.decoder_output(tgt_chunks[i], memory, src_chunks[i]))
            if following is not None:
                memory = move(following, self.dec_dev)
        # Chunks share T but not S (each is padded to the whole batch's S already, so S matches too).
        return type(outputs[0])(*(None if parts[0] is None else torch.cat(parts, dim=0)
                                  for parts in zip(*outputs, strict=True)))


def place_model(model: nn.Module, rt: Runtime, chunks: int = 1) -> nn.Module:
    if rt.device != rt.decoder_device:
        return PlacedSeq2Seq(model, rt.device, rt.decoder_device, chunks)
    return model.to(rt.device)


def _without_inner(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict's post-hook: `prefix`inner.k -> `prefix`k, in order (the subtree's keys are the newest)."""
    for key in [k for k in state_dict if k.startswith(prefix + "inner.")]:
        state_dict[prefix + key[len(prefix) + len("inner."):]] = state_dict.pop(key)


def _with_inner(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict's pre-hook: `prefix`k -> `prefix`inner.k (on load_state_dict's own copy of the dict)."""
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "inner.")]:
        state_dict[prefix + "inner." + key[len(prefix):]] = state_dict.pop(key)
