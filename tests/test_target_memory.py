"""Memory at size: a prompt's head runs on the rows the caller uses, and loading converts
each tensor in place of its original instead of beside it."""

import mlx.core as mx
import pytest
from testkit.target_helpers import twin_models

from mlx_dspark.models import nemotron_h as T
from testkit.toy import tiny_config


@pytest.fixture(scope="module")
def wide_vocab():
    return twin_models(tiny_config(vocab_size=32768))[0]


def _tokens(n, vocab, seed=0):
    return mx.random.randint(0, vocab, (1, n), key=mx.random.key(seed))


@pytest.mark.parametrize("length", [5, 40])
def test_last_only_step_gives_the_last_row_and_the_same_state(wide_vocab, length, monkeypatch):
    monkeypatch.setattr(T, "PREFILL_STEP", 16)          # 40 tokens go in three pieces
    m = wide_vocab
    toks = _tokens(length, 32768)
    full_cache, last_cache = m.make_cache(), m.make_cache()
    full, ftaps = m.step(toks, full_cache, tap_layers=(1, 3))
    last, ltaps = m.step(toks, last_cache, tap_layers=(1, 3), last_only=True)
    assert last.shape == (1, 1, 32768)
    assert mx.array_equal(last[:, 0], full[:, -1])
    assert mx.array_equal(ftaps, ltaps)
    nxt = toks[:, :1]
    assert mx.array_equal(m.step(nxt, full_cache)[0], m.step(nxt, last_cache)[0])


def _prefill_peak(model, n, last_only):
    toks = _tokens(n, model.config.vocab_size, seed=n)
    mx.eval(toks)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(model.step(toks, model.make_cache(), last_only=last_only)[0])
    return mx.get_peak_memory() - base


def test_prefill_memory_is_flat_in_prompt_length_with_last_only(wide_vocab):
    """Full logits of 512 extra positions are 64 MiB at this vocabulary; the last-only
    prefill grows by a small fraction of that (attention scores, activations, caches)."""
    m = wide_vocab
    logits_bytes = (576 - 64) * 32768 * 4
    full_growth = _prefill_peak(m, 576, False) - _prefill_peak(m, 64, False)
    last_growth = _prefill_peak(m, 576, True) - _prefill_peak(m, 64, True)
    assert full_growth > logits_bytes                   # the measurement sees the logits
    assert last_growth < 0.2 * logits_bytes


def test_loading_never_holds_a_tensor_twice(tmp_path):
    """A BF16 checkpoint loaded for fp32 compute: every weight is upcast. The allocator's
    peak stays within 5% of the loaded model plus the largest source tensor: each original
    is freed as its fp32 copy is made (holding them all would add half the model)."""
    import json

    from testkit.toy import hf_weights_from_mlx_lm, random_mlx_lm_model

    cfg = tiny_config("M*-M*-M*-", hidden_size=512, intermediate_size=1024,
                      vocab_size=1024, mamba_num_heads=16, mamba_head_dim=32)
    w = {k: v.astype(mx.bfloat16) for k, v in
         hf_weights_from_mlx_lm(random_mlx_lm_model(cfg)).items()}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), w)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    largest = max(v.nbytes for v in w.values())
    del w
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    model = T.load_target(str(tmp_path), dtype=mx.float32)
    loaded = mx.get_active_memory() - base
    peak = mx.get_peak_memory() - base
    assert model.embeddings.dtype == mx.bfloat16        # one row per token is read
    assert model.embed(mx.array([[3]])).dtype == mx.float32
    assert peak <= 1.05 * loaded + largest
