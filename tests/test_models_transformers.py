"""Hugging Face transformers models, built from tiny configs with random weights, trained with rematd attached
by default through store, selective and recompute: every loss, gradient and parameter bitwise as without it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from rematd import client
from rematd.planner import Mode

from .model_matrix import Case, hf_loss, train_side_by_side

transformers = pytest.importorskip("transformers")

VOCAB = 64
SEQ = 12


def tokens(seed: int, *, size: int = 2, seq: int = SEQ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (size, seq), generator=gen)


def padding(seq: int = SEQ, *, left: bool = False) -> torch.Tensor:
    """The second row is padded by a quarter of its length."""
    mask = torch.ones(2, seq, dtype=torch.long)
    pad = seq // 4
    if left:
        mask[1, :pad] = 0
    else:
        mask[1, -pad:] = 0
    return mask


def causal_lm_batch(*, left_padding: bool) -> Callable[[int], dict[str, Any]]:
    def batch(seed: int) -> dict[str, Any]:
        ids = tokens(seed)
        mask = padding(left=left_padding)
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return batch


def seeded(build: Callable[[], nn.Module], attn: str | None = None) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        model = build()
        if attn is not None:
            model.set_attn_implementation(attn)
        return model

    return make


def gpt2(attn: str) -> Case:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=VOCAB, resid_pdrop=0.1, embd_pdrop=0.1
    )
    cfg.attn_pdrop = 0.1
    return Case(
        seeded(lambda: transformers.GPT2LMHeadModel(cfg), attn),
        causal_lm_batch(left_padding=False),
        hf_loss,
    )


def decoder(config_cls: str, model_cls: str, attn: str | None = None, **extra: Any) -> Case:
    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # grouped-query attention
        "max_position_embeddings": 64,
        "attention_dropout": 0.1,
    }
    cfg = getattr(transformers, config_cls)(**{**settings, **extra})
    return Case(
        seeded(lambda: getattr(transformers, model_cls)(cfg), attn),
        causal_lm_batch(left_padding=True),
        hf_loss,
    )


def bert() -> Case:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=3,
    )

    def batch(seed: int) -> dict[str, Any]:
        return {"input_ids": tokens(seed), "attention_mask": padding(), "labels": torch.tensor([0, 2])}

    return Case(seeded(lambda: transformers.BertForSequenceClassification(cfg)), batch, hf_loss)


def seq2seq_batch(seed: int) -> dict[str, Any]:
    return {
        "input_ids": tokens(seed),
        "attention_mask": padding(),
        "labels": tokens(seed + 1000, seq=SEQ // 2),
    }


def t5() -> Case:
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return Case(seeded(lambda: transformers.T5ForConditionalGeneration(cfg)), seq2seq_batch, hf_loss)


def bart() -> Case:
    cfg = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.1,
        attention_dropout=0.1,
    )
    return Case(seeded(lambda: transformers.BartForConditionalGeneration(cfg)), seq2seq_batch, hf_loss)


def vit() -> Case:
    cfg = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_labels=3,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )

    def batch(seed: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=gen), "labels": torch.tensor([1, 2])}

    return Case(seeded(lambda: transformers.ViTForImageClassification(cfg)), batch, hf_loss)


ROUTER: dict[str, Any] = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1}
"""The mixtures of experts' routers: each token to its top 2 experts, the router's auxiliary loss in the loss."""

CASES: dict[str, Callable[[], Case]] = {
    "gpt2-eager": lambda: gpt2("eager"),
    "gpt2-sdpa": lambda: gpt2("sdpa"),
    "llama": lambda: decoder("LlamaConfig", "LlamaForCausalLM"),
    "llama-eager": lambda: decoder("LlamaConfig", "LlamaForCausalLM", "eager"),
    "qwen2": lambda: decoder("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": lambda: decoder("MistralConfig", "MistralForCausalLM", sliding_window=None),
    "mixtral-moe": lambda: decoder(
        "MixtralConfig",
        "MixtralForCausalLM",
        num_local_experts=4,
        **ROUTER,
    ),
    "qwen2-moe": lambda: decoder(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        **ROUTER,
    ),
    "qwen3-moe": lambda: decoder(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        num_experts=4,
        moe_intermediate_size=32,
        **ROUTER,
    ),
    "olmoe": lambda: decoder(
        "OlmoeConfig",
        "OlmoeForCausalLM",
        num_experts=4,
        **ROUTER,
    ),
    "deepseek-v3": lambda: decoder(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,  # a dense block, then a mixture of experts
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        num_key_value_heads=4,  # latent attention: as many key/value heads as query heads
    ),
    "gpt-oss": lambda: decoder(
        "GptOssConfig",
        "GptOssForCausalLM",
        num_local_experts=4,
        head_dim=8,
        sliding_window=8,
        **ROUTER,
    ),
    "bert": bert,
    "t5": t5,
    "bart": bart,
    "vit": vit,
}

BLOCKS = {
    "gpt2-eager": ["transformer.h.0", "transformer.h.1"],
    "gpt2-sdpa": ["transformer.h.0", "transformer.h.1"],
    "llama": ["model.layers.0", "model.layers.1"],
    "llama-eager": ["model.layers.0", "model.layers.1"],
    "qwen2": ["model.layers.0", "model.layers.1"],
    "mistral": ["model.layers.0", "model.layers.1"],
    "mixtral-moe": ["model.layers.0", "model.layers.1"],
    "qwen2-moe": ["model.layers.0", "model.layers.1"],
    "qwen3-moe": ["model.layers.0", "model.layers.1"],
    "olmoe": ["model.layers.0", "model.layers.1"],
    "deepseek-v3": ["model.layers.0", "model.layers.1"],
    "gpt-oss": ["model.layers.0", "model.layers.1"],
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
    "t5": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
    "bart": ["model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0", "model.decoder.layers.1"],
    "vit": ["vit.layers.0", "vit.layers.1"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_trains_bitwise_as_without_rematd(name: str) -> None:
    h = train_side_by_side(CASES[name]())
    assert h.blocks == BLOCKS[name], "the blocks docs/client.md's table lists"


class KeywordBlock(nn.Module):
    """Called with keyword arguments only, returning a ``ModelOutput``: the shapes transformers blocks take."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * d, d))

    def forward(self, *, hidden_states: torch.Tensor, scale: torch.Tensor) -> Any:
        out = hidden_states + self.mlp(self.norm(hidden_states)) * scale
        return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=out, hidden_states=(hidden_states,))


class KeywordModel(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(KeywordBlock(d) for _ in range(3))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        scale = torch.ones(1, requires_grad=False) * 0.5
        for block in self.blocks:
            x = block(hidden_states=x, scale=scale).last_hidden_state
        logits: torch.Tensor = self.head(x)
        return logits


def test_blocks_called_by_keyword_returning_model_outputs() -> None:
    def loss(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        logits = model(inputs["input_ids"])
        return nn.functional.cross_entropy(logits.flatten(0, 1), inputs["input_ids"].flatten())

    h = train_side_by_side(Case(seeded(KeywordModel), lambda seed: {"input_ids": tokens(seed)}, loss))
    assert h.blocks == ["blocks.0", "blocks.1", "blocks.2"]


def test_an_encoder_decoder_of_unequal_depths_gets_every_block() -> None:
    """distilbart-12-6, distil-whisper-32-2: a shorter decoder's blocks are planned too, in the order they run."""
    cfg = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    model = transformers.BartForConditionalGeneration(cfg)
    h = client.attach(model)
    assert h.blocks == ["model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0"]
    model(**seq2seq_batch(0)).loss.backward()
    h.step()
    assert h.last_stats is not None and h.last_stats.step == 0
    h.close()


BUDGETED: dict[str, Callable[[], Case]] = {
    "qwen3-moe": lambda: decoder(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_hidden_layers=4, num_experts=4, moe_intermediate_size=32, **ROUTER
    ),
    "mixtral-moe": lambda: decoder(
        "MixtralConfig", "MixtralForCausalLM", num_hidden_layers=4, num_local_experts=4, **ROUTER
    ),
}
"""Mixtures of experts deep enough (4 blocks) that a budget between recomputing and storing every block leaves the
planner a choice."""


def saved_peaks(case: Case) -> dict[Mode, int]:
    """The bytes a step saves for backward with every block recomputed, and with every block stored."""
    model = case.build().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    h = client.attach(model, optimizer=opt)
    peaks = {}
    for step, mode in enumerate((None, Mode.RECOMPUTE, Mode.STORE)):
        if mode is not None:
            h.pin_modes(mode)
        case.loss(model, case.batch(step)).backward()
        opt.step()  # ends the handle's step
        opt.zero_grad(set_to_none=True)
        assert h.last_stats is not None
        if mode is not None:
            peaks[mode] = h.last_stats.saved_peak_bytes
    h.close()
    return peaks


@pytest.mark.parametrize("name", list(BUDGETED))
def test_a_mixture_of_experts_trains_bitwise_under_a_budget_between_recomputing_and_storing(name: str) -> None:
    case = BUDGETED[name]()
    peaks = saved_peaks(case)
    assert peaks[Mode.RECOMPUTE] < peaks[Mode.STORE], peaks
    budget = (peaks[Mode.RECOMPUTE] + peaks[Mode.STORE]) // 2
    ref, model = case.build().train(), case.build().train()
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
    # On the CPU a step whose saved bytes would cross the hard limit raises, as the device would run out; planned
    # on the training thread, the first plan is in force at the step after profiling on every run.
    h = client.attach(model, optimizer=opt, budget_bytes=budget, hard_limit_bytes=budget, planner_thread=False)
    ran, measured = [], []
    try:
        for step in range(3):
            inputs = case.batch(step)
            losses = []
            for m, o in ((ref, opt_ref), (model, opt)):
                torch.manual_seed(100 + step)  # dropout draws the same numbers in both
                loss = case.loss(m, inputs if m is model else {**inputs, "use_cache": False})
                loss.backward()
                losses.append(loss.detach())
                if m is model:
                    ran.append(list(h.modes))  # the modes of the step that ends at the optimizer's step
                o.step()
                o.zero_grad(set_to_none=True)
            assert h.last_stats is not None and h.last_stats.step == step
            measured.append(h.last_stats.saved_peak_bytes)
            assert torch.equal(losses[0], losses[1]), f"step {step} ({ran[-1]}): loss {losses[0]} != {losses[1]}"
            for (n, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
                assert torch.equal(p, q), f"step {step} ({ran[-1]}): parameter {n}"
    finally:
        h.close()
    blocks = len(h.blocks)
    assert ran[0] == [Mode.RECOMPUTE] * blocks, "the first step profiles, every block recomputed"
    assert ran[1] not in ([Mode.RECOMPUTE] * blocks, [Mode.STORE] * blocks), f"the plan uses the room: {ran}"
    over = [(step, m) for step, m in enumerate(measured) if m > budget]
    assert not over, f"steps over the budget of {budget}: {over}"
    assert all(p.predicted_peak_bytes <= budget for p in h.history), [(p.version, p.reason) for p in h.history]
