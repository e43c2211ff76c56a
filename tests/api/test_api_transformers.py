"""Hugging Face transformers models running their attention on flashtune (the emulator):
tiny randomly initialised Llama (GQA), Mistral (sliding window) and Gemma 2 (softcap and
sliding windows) built from configs, no download, on a batch with left padding (unpadded
through ``attention_varlen``) and one without (the batched op). Their logits are compared
with the same weights under transformers' eager attention in float32; the same models
without the feature (no window, no softcap) are far off, so the comparison sees whether
the feature ran. Mistral and Gemma 2 also train two steps without padding (windows and
softcaps in the backward) and follow eager attention's losses and gradients, as does a tiny
gpt-oss (attention sinks through ``s_aux``, with its sliding and full layers and its MoE).
A tiny Llama trains with attention dropout against plain attention with the tests' own
dropout mask. Tiny Llama and Mistral train on packed sequences (padding-free: one row,
``position_ids`` restarting per sequence, or transformers' flash-attention kwargs) through
the varlen backward and follow eager attention's losses and gradients. The default run
compares a seeded two of the three models' logits and trains one of the two (the seed is
``FLASHTUNE_TEST_SEED``; ``-m sweep`` runs every one).

Skipped without transformers (an optional extra: ``pip install flashtune[transformers]``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sampling import seeded_part

import flashtune
from flashtune.errors import InvalidInput

transformers = pytest.importorskip("transformers")


pytestmark = [pytest.mark.emulator, pytest.mark.usefixtures("dispatcher")]


def _tiny(name: str, **overrides: Any) -> Any:
    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "gemma2": transformers.Gemma2Config}
    features: dict[str, dict[str, Any]] = {
        "llama": {},
        "mistral": {"sliding_window": 5},
        "gemma2": {"sliding_window": 6, "attn_logit_softcapping": 2.0,
                   "final_logit_softcapping": None, "query_pre_attn_scalar": 16}}
    # Large initial weights, so that attention moves the logits by much more than rounding.
    settings = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=64, initializer_range=0.3)
    return classes[name](**(settings | features[name] | overrides))


def _logits(cfg: Any, impl: str, state: dict[str, torch.Tensor], dtype: torch.dtype,
            ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    model.load_state_dict(state)
    model = model.to(dtype).eval()
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return out.float()


@pytest.mark.parametrize("name", seeded_part(["llama", "mistral", "gemma2"], 2, "match"))
def test_tiny_models_match_eager_attention(name: str) -> None:
    impl = flashtune.register_transformers(backend="emulator")
    torch.manual_seed(0)
    cfg = _tiny(name)
    state = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    ids = torch.randint(0, 128, (2, 13))
    padded = torch.ones(2, 13, dtype=torch.long)
    padded[1, :4] = 0  # left padding: the second sequence has 9 tokens
    without = {"sliding_window": 4096 if name == "gemma2" else None,
               "attn_logit_softcapping": None}
    for mask in (padded, None):
        keep = padded.bool() if mask is not None else torch.ones(2, 13, dtype=torch.bool)
        reference = _logits(cfg, "eager", state, torch.float32, ids, mask)[keep]
        rounding = (_logits(cfg, "eager", state, torch.float16, ids, mask)[keep]
                    - reference).abs().max()
        got = _logits(cfg, impl, state, torch.float16, ids, mask)[keep]
        err = float((got - reference).abs().max())
        assert err <= 3 * float(rounding) + 1e-2, (
            f"{name}: |flashtune - eager fp32| = {err:.3g}, eager fp16 rounding {rounding:.3g}")
        if name != "llama":
            plain = _logits(_tiny(name, **without), "eager", state, torch.float32, ids, mask)
            assert float((plain[keep] - reference).abs().max()) > 20 * (err + 1e-2)


def test_names_with_flash_are_refused() -> None:
    with pytest.raises(InvalidInput, match="reserves for FlashAttention kernel packages"):
        flashtune.register_transformers("flashtune")


def test_a_batch_of_padding_only_is_refused_naming_the_padding() -> None:
    """Eager attention gives an all-masked row a uniform average of the values (its mask is
    the dtype's minimum, not -inf): no answer to imitate, so flashtune says what is wrong."""
    impl = flashtune.register_transformers(backend="emulator")
    torch.manual_seed(0)
    cfg = _tiny("llama")
    state = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    ids = torch.randint(0, 128, (2, 7))
    with pytest.raises(InvalidInput, match="every query token of the batch is padding.*"
                                           r"attention_mask \(2, 7\)"):
        _logits(cfg, impl, state, torch.float16, ids, torch.zeros(2, 7, dtype=torch.long))


def _train(cfg: Any, impl: str, state: dict[str, torch.Tensor], ids: torch.Tensor,
           steps: int, positions: torch.Tensor | None = None, **extra: Any
           ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of ``steps`` SGD steps of a float32 model from ``state`` (no padding), and the
    gradients of the first step; ``positions``: the ``position_ids`` (packed sequences),
    ``extra``: more keywords of the model call (transformers' flash-attention kwargs)."""
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    model.load_state_dict(state)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, first = [], {}
    for step in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False,
                     **extra).loss
        loss.backward()
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                     if p.grad is not None}
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, first


@pytest.mark.parametrize("name", seeded_part(["mistral", "gemma2"], 1, "train"))
def test_tiny_models_train_like_eager_attention(name: str) -> None:
    """Two training steps (no padding: the batched op, which has a backward, with the
    model's sliding window and softcap) follow eager attention's losses and first
    gradients; the attention runs in bf16 inside the float32 model (the bounds allow its
    rounding), and the same model without its feature has gradients much further off."""
    impl = flashtune.register_transformers(backend="emulator")
    torch.manual_seed(1)
    cfg = _tiny(name, initializer_range=0.1)
    state = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    ids = torch.randint(0, 128, (2, 13))
    ref_losses, ref_grads = _train(cfg, "eager", state, ids, 2)
    losses, grads = _train(cfg, impl, state, ids, 2)
    assert set(grads) == set(ref_grads)
    for step, (got, ref) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - ref) <= 2e-3 * abs(ref), f"{name} step {step}: loss {got} vs {ref}"
    worst = max(float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12))
                for n in ref_grads)
    assert worst <= 3e-2, f"{name}: worst relative gradient error {worst:.3g}"
    without = {"sliding_window": 4096 if name == "gemma2" else None,
               "attn_logit_softcapping": None, "initializer_range": 0.1}
    _, plain_grads = _train(_tiny(name, **without), "eager", state, ids, 1)
    off = max(float((plain_grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12))
              for n in ref_grads)
    assert off > 5 * worst, f"{name}: without its feature the gradients are off by {off:.3g}"


def _tiny_gpt_oss(sinks: float | None) -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny gpt-oss (one sliding-window and one full layer; every expert routed to, so
    that the MoE is a smooth function of the attention output and rounding cannot flip a
    top-k choice) and its initial state, its sinks drawn with a spread of 2 around 1 (or set
    to ``sinks``: -100.0 makes them vanish)."""
    cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        initializer_range=0.1, num_local_experts=2, num_experts_per_tok=2, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(2)
    state = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    for name in [n for n in state if n.endswith("self_attn.sinks")]:
        state[name] = (torch.randn(4) * 2 + 1 if sinks is None
                       else torch.full((4,), sinks))
    return cfg, state


def test_tiny_gpt_oss_trains_like_eager_attention() -> None:
    """gpt-oss passes its sinks to the attention function as ``s_aux``: two training steps
    follow eager attention's losses and first gradients (the sinks' included), and with the
    sinks vanishing the gradients are much further off."""
    impl = flashtune.register_transformers(backend="emulator")
    cfg, state = _tiny_gpt_oss(None)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    ref_losses, ref_grads = _train(cfg, "eager", state, ids, 2)
    losses, grads = _train(cfg, impl, state, ids, 2)
    assert set(grads) == set(ref_grads)
    assert any(n.endswith("self_attn.sinks") for n in grads)
    for step, (got, ref) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - ref) <= 2e-3 * abs(ref), f"gpt-oss step {step}: loss {got} vs {ref}"
    errors = {n: float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12))
              for n in ref_grads}
    worst = max(errors.values())
    assert worst <= 3e-2, f"gpt-oss: worst relative gradient error {worst:.3g} ({errors})"
    _, plain_state = _tiny_gpt_oss(-100.0)
    plain_state = {n: plain_state[n] if n.endswith("self_attn.sinks") else t
                   for n, t in state.items()}
    _, plain_grads = _train(cfg, "eager", plain_state, ids, 1)
    off = max(float((plain_grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12))
              for n in ref_grads if not n.endswith("self_attn.sinks"))
    assert off > 5 * worst, f"gpt-oss: without its sinks the gradients are off by {off:.3g}"


def test_attention_dropout_trains_like_plain_attention_with_the_same_mask() -> None:
    """A tiny Llama with ``attention_dropout`` in train mode: flashtune's losses and first
    gradients follow a plain PyTorch attention that draws its seed from torch's generator
    as the API does and its mask with the tests' own Philox (``dropout_philox``)."""
    from dropout_philox import float32, mask
    from transformers import AttentionInterface

    def plain(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
              scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        batch, heads, n, _ = query.shape
        group = heads // key.shape[1]
        k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        scores = torch.einsum("bhqd,bhkd->bhqk", query, k) * (scaling or 1.0)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        if dropout:
            high, low = torch.randint(2**32, (2,), dtype=torch.int64).tolist()
            kept = mask(int(high) << 32 | int(low), 0, dropout, range(batch), heads, n, n)
            probs = probs * kept * (1.0 / (1.0 - float32(dropout)))
        return torch.einsum("bhqk,bhkd->bqhd", probs, v), None

    AttentionInterface.register("plaindrop", plain)
    impl = flashtune.register_transformers(backend="emulator")
    torch.manual_seed(2)
    cfg = _tiny("llama", initializer_range=0.1, attention_dropout=0.3, num_hidden_layers=1)
    state = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    ids = torch.randint(0, 128, (2, 13))
    torch.manual_seed(3)
    ref_losses, ref_grads = _train(cfg, "plaindrop", state, ids, 2)
    torch.manual_seed(3)
    losses, grads = _train(cfg, impl, state, ids, 2)
    torch.manual_seed(4)
    other_losses, _ = _train(cfg, impl, state, ids, 1)
    for step, (got, ref) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - ref) <= 2e-3 * abs(ref), f"step {step}: loss {got} vs {ref}"
    assert abs(other_losses[0] - ref_losses[0]) > 1e-2 * abs(ref_losses[0])  # another mask
    worst = max(float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12))
                for n in ref_grads)
    assert worst <= 3e-2, f"worst relative gradient error {worst:.3g}"


#: Three sequences packed back to back in one row (padding-free training).
PACKED_LENGTHS = (7, 4, 9)


def _relative(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((grads[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)) for n in ref)


@pytest.mark.parametrize("name", ["mistral", pytest.param("llama", marks=pytest.mark.sweep)])
def test_packed_sequences_train_like_eager_attention(name: str) -> None:
    """Padding-free training (three sequences in one row, ``position_ids`` restarting at 0
    for each: transformers' masks give eager attention one block per sequence) runs on the
    varlen forward and backward: losses and first gradients follow eager attention's
    (Mistral: GQA and a sliding window; Llama, GQA, under ``-m sweep``), and are much
    closer to them than eager attention over the row as one sequence is. transformers'
    flash-attention kwargs (``cu_seq_lens_q``, ...) give the same sequences, so the same
    bits."""
    impl = flashtune.register_transformers(backend="emulator")
    torch.manual_seed(4)
    cfg = _tiny(name, initializer_range=0.1)
    state = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    ids = torch.randint(0, 128, (1, sum(PACKED_LENGTHS)))
    positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None]
    ref_losses, ref_grads = _train(cfg, "eager", state, ids, 2, positions)
    losses, grads = _train(cfg, impl, state, ids, 2, positions)
    assert set(grads) == set(ref_grads)
    for step, (got, ref) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - ref) <= 2e-3 * abs(ref), f"{name} step {step}: loss {got} vs {ref}"
    worst = _relative(grads, ref_grads)
    assert worst <= 3e-2, f"{name}: worst relative gradient error {worst:.3g}"
    _, whole = _train(cfg, "eager", state, ids, 1, None)
    off = _relative(whole, ref_grads)
    assert off > 5 * worst, f"{name}: one sequence's gradients are only off by {off:.3g}"

    cu = torch.tensor([0, 7, 11, 20], dtype=torch.int32)
    _, kwargs_grads = _train(cfg, impl, state, ids, 1, positions, cu_seq_lens_q=cu,
                                    cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    for n, grad in grads.items():
        assert torch.equal(kwargs_grads[n], grad), n
