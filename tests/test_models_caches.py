"""Key/value caches of transformers models under rematd: training forwards run without one, forwards under
``torch.no_grad()`` keep it as configured, and no forward, nor any recompute, grows a cache twice."""

from __future__ import annotations

import logging

import pytest
import torch

from rematd import client
from rematd.planner import Mode

transformers = pytest.importorskip("transformers")
cache_utils = pytest.importorskip("transformers.cache_utils")

VOCAB = 500


def gpt2(attn: str, *, n_layer: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, n_positions=128, vocab_size=VOCAB)
    model = transformers.GPT2LMHeadModel(cfg)
    model.set_attn_implementation(attn)
    return model.train()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def ids(seed: int, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seed))


CASES = {
    # What broke as a new user first tried it: the recompute ran the block again against the model's cache.
    "gpt2-eager-recompute": (lambda: gpt2("eager"), Mode.RECOMPUTE),
    "gpt2-eager-selective": (lambda: gpt2("eager"), Mode.SELECTIVE),
    "gpt2-sdpa-selective": (lambda: gpt2("sdpa"), Mode.SELECTIVE),
    "llama-sdpa-selective": (llama, Mode.SELECTIVE),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_checkpointed_block_does_not_run_against_the_cache(name: str, caplog: pytest.LogCaptureFixture) -> None:
    build, mode = CASES[name]
    model = build()
    assert model.config.use_cache, "the default the failure needed"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = client.attach(model)
    with caplog.at_level(logging.INFO, logger="rematd.client"):
        for step in range(3):
            if step == 1:
                h.pin_modes([mode] * len(h.blocks))
            b = ids(step)
            out = model(input_ids=b, labels=b)
            assert out.past_key_values is None, "a training forward builds no cache"
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            h.step()
            assert torch.isfinite(out.loss)
    assert h.modes == (mode,) * len(h.blocks)
    said = [r for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, "logged once, not as an error"
    assert model.config.use_cache, "the user's configuration is left as it was"
    h.close()


def test_no_grad_forwards_keep_the_cache_and_generate_as_without_rematd() -> None:
    model, plain = gpt2("eager", n_layer=2), gpt2("eager", n_layer=2)
    h = client.attach(model)
    for step in range(2):
        if step == 1:
            h.pin_modes([Mode.RECOMPUTE] * len(h.blocks))
        b = ids(step)
        model(input_ids=b, labels=b).loss.backward()
        h.step()
    model.zero_grad()
    model.eval()
    prompt = ids(7, seq=5)
    with torch.no_grad():
        out = model(input_ids=prompt)
        assert isinstance(out.past_key_values, cache_utils.Cache)
        assert out.past_key_values.get_seq_length() == 5, "the cache holds each token once"
        # A step of decoding against that cache, as generation does.
        nxt = model(input_ids=prompt[:, -1:], past_key_values=out.past_key_values)
        assert nxt.past_key_values.get_seq_length() == 6
    # Training changed no weight here (no optimizer step): generation is exactly the unattached model's.
    plain.eval()
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(prompt, **kwargs), plain.generate(prompt, **kwargs))
    h.close()


def test_a_cache_the_caller_passes_is_updated_once_and_gradients_match() -> None:
    """A training forward over a prefix cache (prefix tuning, continued sequences) updates it exactly once."""
    model, plain = gpt2("eager", n_layer=2), gpt2("eager", n_layer=2)
    h = client.attach(model)
    b = ids(0)
    model(input_ids=b, labels=b).loss.backward()
    h.step()
    model.zero_grad()
    h.pin_modes([Mode.RECOMPUTE] * len(h.blocks))
    prefix = ids(1, seq=4)
    grads = []
    for m in (model, plain):
        torch.manual_seed(3)  # the same dropout in both
        with torch.no_grad():
            cache = m(input_ids=prefix, use_cache=True).past_key_values
        b = ids(2, seq=8)
        out = m(input_ids=b, labels=b, past_key_values=cache, use_cache=True)
        out.loss.backward()
        assert cache.get_seq_length() == 12, "prefix and batch, once each"
        grads.append([p.grad.clone() for p in m.parameters()])
    assert all(torch.equal(a, c) for a, c in zip(*grads, strict=True))
    h.close()


def test_a_block_run_storing_for_a_cache_is_timed_as_storing() -> None:
    """A block pinned to recompute that stores because it was handed a cache must not report a free recompute."""
    model = gpt2("eager", n_layer=2)
    h = client.attach(model)
    b = ids(0)
    model(input_ids=b, labels=b).loss.backward()
    h.step()
    model.zero_grad()
    h.pin_modes([Mode.RECOMPUTE] * len(h.blocks))
    with torch.no_grad():
        cache = model(input_ids=ids(1, seq=4), use_cache=True).past_key_values
    b = ids(2, seq=8)
    model(input_ids=b, labels=b, past_key_values=cache, use_cache=True).loss.backward()
    h.step()
    assert h.last_stats is not None
    ((timed,),) = (h.last_stats.mode_seconds,)
    assert timed.mode == Mode.STORE and timed.blocks == 2 and timed.seconds == 0
    h.close()


def test_the_hooks_go_with_close() -> None:
    model = gpt2("eager", n_layer=2)
    h = client.attach(model)
    h.close()
    b = ids(0)
    out = model(input_ids=b, labels=b)
    assert isinstance(out.past_key_values, cache_utils.Cache), "closed: the model's own behaviour is back"
