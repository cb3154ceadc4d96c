"""The next-token KL and token loss accumulator against torch's kl_div and cross_entropy on the full
tensors in float64 (independent of graphcal.evaluation.next_token's slicing, masking and shifting)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from graphcal.errors import GraphcalError
from graphcal.evaluation import next_token
from graphcal.evaluation.next_token import NextTokenLoss, logits_output


def _logits(seed, shape, scale=3.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _reference_kl(ref, cand, mask=None) -> float:
    """Mean over kept positions of KL(softmax(ref) || softmax(cand)), torch on the whole tensors."""
    r = torch.log_softmax(torch.as_tensor(ref, dtype=torch.float64), -1)
    c = torch.log_softmax(torch.as_tensor(cand, dtype=torch.float64), -1)
    per = F.kl_div(c, r, log_target=True, reduction="none").sum(-1)  # KL(p_ref || p_cand) per position
    if mask is not None:
        per = per[torch.as_tensor(mask) != 0]
    return float(per.mean())


def _reference_loss(logits, labels) -> float:
    """transformers' causal LM loss: logits[:, :-1] score labels[:, 1:], -100 ignored."""
    x = torch.as_tensor(logits, dtype=torch.float64)[:, :-1].reshape(-1, logits.shape[-1])
    return float(F.cross_entropy(x, torch.as_tensor(labels, dtype=torch.int64)[:, 1:].reshape(-1), ignore_index=-100))


@pytest.fixture
def small_chunks(monkeypatch):
    """Slices of 3 positions of a 37-token vocabulary: batches cross slice boundaries mid-row-set."""
    monkeypatch.setattr(next_token, "CHUNK", 3 * 37)


@pytest.mark.parametrize("as_torch", [False, True])
def test_kl_and_loss_match_torch_across_batches_slices_and_masks(small_chunks, as_torch):
    acc = NextTokenLoss("logits")
    refs, cands, masks, labels = [], [], [], []
    for b, (batch, seq) in enumerate([(2, 5), (3, 4)]):
        ref = _logits(b, (batch, seq, 37))
        cand = ref + _logits(10 + b, (batch, seq, 37), 0.7)
        mask = np.ones((batch, seq), np.int64)
        mask[0, -2:] = 0  # right padding
        label = np.random.default_rng(20 + b).integers(0, 37, (batch, seq))
        label[1, 2] = -100
        feed = (torch.as_tensor(ref), torch.as_tensor(cand)) if as_torch else (ref, cand)
        acc.add(*feed, mask=mask, labels=label)
        refs.append(ref.reshape(-1, 37)), cands.append(cand.reshape(-1, 37))
        masks.append(mask.reshape(-1)), labels.append((ref, cand, label))
    want_kl = _reference_kl(np.concatenate(refs), np.concatenate(cands), np.concatenate(masks))
    assert acc.kl == pytest.approx(want_kl, rel=1e-12)
    assert acc.positions == int(np.concatenate(masks).sum())
    # the token loss: a mean over every scored label of both batches
    scored = [int((lab[:, 1:] != -100).sum()) for _, _, lab in labels]
    want_ref = sum(_reference_loss(r, lab) * n for (r, _, lab), n in zip(labels, scored)) / sum(scored)
    want_cand = sum(_reference_loss(c, lab) * n for (_, c, lab), n in zip(labels, scored)) / sum(scored)
    assert acc.tokens == sum(scored) and acc.labelled
    assert acc.ref_loss == pytest.approx(want_ref, rel=1e-12)
    assert acc.loss == pytest.approx(want_cand, rel=1e-12)
    assert acc.measure == pytest.approx(want_cand - want_ref, rel=1e-9)


def test_a_mask_not_shaped_as_the_positions_is_not_applied_and_equal_logits_lose_nothing():
    ref = _logits(0, (2, 3, 11))
    cand = ref * 1.1
    acc = NextTokenLoss("logits")
    acc.add(ref, cand, mask=np.zeros((2, 7), np.int64))  # a mask over past + sequence: not these positions
    assert acc.positions == 6 and acc.kl == pytest.approx(_reference_kl(ref, cand), rel=1e-12)
    same = NextTokenLoss("logits")
    same.add(ref, ref.copy())
    assert same.kl == 0.0 and not same.labelled and same.measure == 0.0


def test_a_large_vocabulary_goes_a_slice_at_a_time():
    """A vocabulary past CHUNK elements: one position per slice, still exact."""
    ref = _logits(1, (1, 3, next_token.CHUNK + 5), 1.0)
    cand = ref + _logits(2, ref.shape, 0.1)
    acc = NextTokenLoss("logits")
    acc.add(ref, cand)
    assert acc.kl == pytest.approx(_reference_kl(ref, cand), rel=1e-10)


@pytest.mark.parametrize("labels, fragment", [
    (np.zeros((2, 4), np.int64), "do not match the logits' positions"),
    (np.full((2, 3), 11, np.int64), "is not a token of the 11-token vocabulary"),
    (np.zeros((2, 3), np.float32), "must be integer token ids"),
])
def test_bad_labels_are_one_line_errors(labels, fragment):
    with pytest.raises(GraphcalError, match=fragment):
        NextTokenLoss("logits").add(_logits(0, (2, 3, 11)), _logits(1, (2, 3, 11)), labels=labels)


def test_the_logits_output_is_found_by_name_or_by_the_lm_heads_width(llama_dir, bert_dir):
    from graphcal.graph.targets import find_targets

    llama = onnx.load(llama_dir / "model.onnx", load_external_data=False)
    assert logits_output(llama, find_targets(llama)[0]) == "logits"
    llama.graph.output[0].name = "scores"  # renamed: found by the lm_head's 256 outputs
    assert logits_output(llama, find_targets(llama)[0]) == "scores"
    bert = onnx.load(bert_dir / "model.onnx", load_external_data=False)
    assert logits_output(bert, find_targets(bert)[0]) is None


@pytest.mark.gpu
def test_on_a_gpu_the_sums_are_taken_there_and_equal_the_cpus():
    ref = _logits(3, (2, 6, 300))
    cand = ref + _logits(4, ref.shape, 0.5)
    labels = np.random.default_rng(5).integers(0, 300, (2, 6))
    mask = np.ones((2, 6), np.int64)
    mask[1, :2] = 0
    cpu, gpu = NextTokenLoss("logits"), NextTokenLoss("logits")
    cpu.add(ref, cand, mask=mask, labels=labels)
    gpu.add(torch.as_tensor(ref).cuda(), torch.as_tensor(cand).cuda(), mask=mask, labels=labels)
    assert gpu.positions == cpu.positions and gpu.tokens == cpu.tokens
    assert gpu.kl == pytest.approx(cpu.kl, rel=1e-9) and gpu.loss == pytest.approx(cpu.loss, rel=1e-9)
