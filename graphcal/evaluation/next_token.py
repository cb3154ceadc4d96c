"""What a user loses at the next token: KL divergence of the next-token distributions, and the token loss.

For a model whose output is logits (``[..., vocab]``), :class:`NextTokenLoss` streams, batch by batch,

- the mean over positions of KL(p_ref || p_cand), p the softmax over the last axis, leaving out the
  positions where the batch's ``attention_mask`` is 0 (when its shape is the logits' leading axes);
- where the data holds ``labels`` (shaped as ``input_ids``; -100 ignored), the mean token loss
  (cross-entropy) of both models, as transformers' causal LM loss takes it: the logits at position t
  score the label at t+1.

Both in float64, a slice of positions at a time (a large vocabulary's logits in float64 whole would be
several times the batch's own memory), for numpy arrays and for torch tensors (a GPU session's outputs:
computed where they lie, a few numbers come back per batch). :func:`logits_output` finds the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from graphcal.data.load import LABELS
from graphcal.errors import GraphcalError
from graphcal.evaluation.agreement import CHUNK, is_torch

LOGITS = "logits"  # the name transformers' and Optimum's exports and onnxruntime-genai's builder give it
MASK = "attention_mask"
IGNORE_INDEX = -100  # a label that is not scored (torch's cross_entropy ignore_index default)


@dataclass
class NextTokenLoss:
    """Streaming next-token KL (and, with labels, token loss) of a candidate's logits against a reference's."""

    name: str
    kl_sum: float = 0.0
    positions: int = 0  # positions in the KL (the mask's kept ones)
    ref_nll: float = 0.0  # summed token loss of the reference (with labels)
    cand_nll: float = 0.0
    tokens: int = 0  # scored labels

    def add(self, ref, cand, mask=None, labels=None) -> None:
        """Fold in one batch: ``ref``/``cand`` logits ``[..., vocab]``; ``mask`` the batch's attention
        mask (used where its shape is the logits' leading axes); ``labels`` as ``input_ids``."""
        if is_torch(ref) or is_torch(cand):
            self._add_torch(ref, cand, mask, labels)
            return
        ref, cand = np.asarray(ref), np.asarray(cand)
        rows, keep, targets = self._layout(tuple(ref.shape), tuple(cand.shape), mask, labels)
        if rows == 0:
            return
        vocab = ref.shape[-1]
        ref, cand = ref.reshape(rows, vocab), cand.reshape(rows, vocab)
        step = max(CHUNK // max(vocab, 1), 1)
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            # log p = x - log sum exp x, with x shifted by its row max; per row,
            # KL = sum p_r (x_r - x_c) - log S_r + log S_c  (S = sum exp x; sum p_r = 1): two exps, no log-softmax copies
            xr, xc = ref[start:stop].astype(np.float64), cand[start:stop].astype(np.float64)
            xr -= xr.max(axis=-1, keepdims=True)
            xc -= xc.max(axis=-1, keepdims=True)
            er = np.exp(xr)
            sr = er.sum(axis=-1)
            log_sr, log_sc = np.log(sr), np.log(np.exp(xc).sum(axis=-1))
            if targets is not None:
                t = targets[start:stop]
                scored = np.flatnonzero(t != IGNORE_INDEX)
                if scored.size:
                    self.ref_nll -= float((xr[scored, t[scored]] - log_sr[scored]).sum())
                    self.cand_nll -= float((xc[scored, t[scored]] - log_sc[scored]).sum())
                    self.tokens += int(scored.size)
            np.subtract(xr, xc, out=xc)
            per = np.einsum("ij,ij->i", er, xc) / sr - log_sr + log_sc
            kept = per[keep[start:stop]] if keep is not None else per
            self.kl_sum += float(kept.sum())
            self.positions += int(kept.shape[0])

    def _add_torch(self, ref, cand, mask, labels) -> None:
        """:meth:`add` for torch tensors (a GPU session's outputs, handed over by DLPack): the same sums in
        float64 where the tensors lie, a slice of positions at a time; four numbers come back."""
        import torch  # lazy: only where a runner hands over torch tensors (it imported torch)

        ref = ref if is_torch(ref) else torch.as_tensor(np.asarray(ref))
        cand = (cand if is_torch(cand) else torch.as_tensor(np.asarray(cand))).to(ref.device)
        rows, keep, targets = self._layout(tuple(ref.shape), tuple(cand.shape), mask, labels)
        if rows == 0:
            return
        device, vocab = ref.device, ref.shape[-1]
        ref, cand = ref.reshape(rows, vocab), cand.reshape(rows, vocab)
        keep = torch.as_tensor(keep, device=device) if keep is not None else None
        targets = torch.as_tensor(targets, device=device) if targets is not None else None
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # KL, reference and candidate token loss
        step = max(CHUNK // max(vocab, 1), 1)
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            r = torch.log_softmax(ref[start:stop].to(torch.float64), dim=-1)
            c = torch.log_softmax(cand[start:stop].to(torch.float64), dim=-1)
            rk, ck = (r[keep[start:stop]], c[keep[start:stop]]) if keep is not None else (r, c)
            sums[0] += (rk.exp() * (rk - ck)).sum()
            if targets is not None:
                t = targets[start:stop]
                scored = (t != IGNORE_INDEX).nonzero().squeeze(1)
                picked = t[scored].unsqueeze(1)
                sums[1] -= r[scored].gather(1, picked).sum()
                sums[2] -= c[scored].gather(1, picked).sum()
        kl, ref_nll, cand_nll = sums.tolist()
        self.kl_sum += kl
        self.ref_nll += ref_nll
        self.cand_nll += cand_nll
        self.positions += int(keep.sum()) if keep is not None else rows
        self.tokens += int((targets != IGNORE_INDEX).sum()) if targets is not None else 0

    def _layout(self, ref_shape: tuple, cand_shape: tuple, mask, labels) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """(positions, the kept ones as a flat bool array or None for all, each position's next label
        flat or None), checked against the logits' shape."""
        if ref_shape != cand_shape:
            raise GraphcalError(f"{self.name}: shapes differ between the models ({ref_shape} vs {cand_shape})")
        if len(ref_shape) < 2:
            raise GraphcalError(f"{self.name}: logits need a vocabulary axis after the positions, got shape {ref_shape}")
        lead = ref_shape[:-1]
        rows = math.prod(lead)
        keep = None
        if mask is not None:
            mask = np.asarray(mask.cpu() if is_torch(mask) else mask)
            if tuple(mask.shape) == lead:
                keep = mask.reshape(-1) != 0
        targets = None
        if labels is not None:
            labels = np.asarray(labels.cpu() if is_torch(labels) else labels)
            if len(lead) != 2 or tuple(labels.shape) != lead:
                raise GraphcalError(f"{self.name}: labels {tuple(labels.shape)} do not match the logits' positions "
                                    f"{lead} ([batch, sequence], as input_ids)")
            if labels.dtype.kind not in "iu":
                raise GraphcalError(f"{self.name}: labels must be integer token ids, got {labels.dtype}")
            shifted = np.full(lead, IGNORE_INDEX, dtype=np.int64)
            shifted[:, :-1] = labels[:, 1:]  # the logits at t score the label at t + 1
            scored = shifted[shifted != IGNORE_INDEX]
            if scored.size and (scored.min() < 0 or scored.max() >= ref_shape[-1]):
                bad = int(scored[(scored < 0) | (scored >= ref_shape[-1])][0])
                raise GraphcalError(f"{self.name}: label {bad} is not a token of the {ref_shape[-1]}-token vocabulary "
                                    f"(nor {IGNORE_INDEX}, ignored)")
            targets = shifted.reshape(-1)
        return rows, keep, targets

    @property
    def labelled(self) -> bool:
        return self.tokens > 0

    @property
    def kl(self) -> float:
        """Mean next-token KL(p_ref || p_cand) in nats per position."""
        return self.kl_sum / self.positions if self.positions else 0.0

    @property
    def ref_loss(self) -> float:
        """The reference's mean token loss (nats per scored label)."""
        return self.ref_nll / self.tokens if self.tokens else math.nan

    @property
    def loss(self) -> float:
        """The candidate's mean token loss (nats per scored label)."""
        return self.cand_nll / self.tokens if self.tokens else math.nan

    @property
    def loss_increase(self) -> float:
        return self.loss - self.ref_loss

    @property
    def measure(self) -> float:
        """What mixing ranks by: the token loss increase over the reference where labels were given, else the KL."""
        return self.loss_increase if self.labelled else self.kl

    def as_dict(self) -> dict:
        out = {"name": self.name, "kl": self.kl, "positions": self.positions}
        if self.labelled:
            out.update(loss=self.loss, reference_loss=self.ref_loss, tokens=self.tokens)
        return out


def logits_output(model: onnx.ModelProto, targets) -> str | None:
    """The model's logits output: the graph output named ``logits``, else the float output of rank 2 or more
    whose last axis is the lm_head's output width (``targets``: the model's weight MatMul/Gemm targets);
    None for a model without one (an encoder)."""
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
    outputs = [o for o in model.graph.output if o.type.tensor_type.elem_type in floats]
    if any(o.name == LOGITS for o in outputs):
        return LOGITS
    head = next((t for t in targets if t.name == "lm_head" or t.name.endswith(".lm_head")), None)
    if head is None:
        return None
    for o in outputs:
        dims = o.type.tensor_type.shape.dim
        if len(dims) >= 2 and dims[-1].HasField("dim_value") and dims[-1].dim_value == head.out_features:
            return o.name
    return None


def split_labels(batch: dict) -> tuple[dict, np.ndarray | None]:
    """(what the model is fed, the data's labels or None): eval's batches carry ``labels`` beside the inputs."""
    if LABELS not in batch:
        return batch, None
    return {k: v for k, v in batch.items() if k != LABELS}, batch[LABELS]
