"""Block discovery on small look-alikes of the models people train (no downloads, no transformers package)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rematd import client
from rematd.planner import Mode


class GPT2Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True, dropout=0.1)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT2Body(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, d)
        self.wpe = nn.Embedding(64, d)
        self.h = nn.ModuleList(GPT2Block(d) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)


class GPT2LMHeadModel(nn.Module):
    """GPT-2's layout: ``transformer.h`` holds the blocks."""

    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.transformer = GPT2Body(d, n)
        self.lm_head = nn.Linear(d, 64, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        for block in t.h:
            x = block(x)
        out: torch.Tensor = self.lm_head(t.ln_f(x))
        return out


class LlamaRMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LlamaMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, 2 * d, bias=False)
        self.up_proj = nn.Linear(d, 2 * d, bias=False)
        self.down_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class LlamaDecoderLayer(nn.Module):
    """Hugging Face's calling convention: keyword arguments in, a tuple out."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(d)
        self.mlp = LlamaMLP(d)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: object = None
    ) -> tuple[torch.Tensor]:
        y = self.input_layernorm(hidden_states)
        att = F.scaled_dot_product_attention(self.q(y), self.k(y), self.v(y), attn_mask=attention_mask)
        h = hidden_states + self.o(att)
        return (h + self.mlp(self.post_attention_layernorm(h)),)


class LlamaModel(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, d)
        self.layers = nn.ModuleList(LlamaDecoderLayer(d) for _ in range(n))
        self.norm = LlamaRMSNorm(d)


class LlamaForCausalLM(nn.Module):
    """Llama's layout: ``model.layers`` holds the blocks."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.model = LlamaModel(d, n)
        self.lm_head = nn.Linear(d, 64, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, attention_mask=mask, position_ids=torch.arange(t))[0]
        out: torch.Tensor = self.lm_head(self.model.norm(x))
        return out


class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder``: its ``layers`` hold the blocks."""

    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, d)
        layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n, enable_nested_tensor=False)
        self.head = nn.Linear(d, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(self.embed(idx)))
        return out


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (self.downsample(x) if self.downsample is not None else x))


class ResNetLike(nn.Module):
    """Four stages (``layer1``..``layer4``) of residual blocks of growing width and shrinking size."""

    def __init__(self, widths: tuple[int, ...] = (4, 8, 16, 16), depths: tuple[int, ...] = (2, 2, 1, 1)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        cin = widths[0]
        for i, (w, n) in enumerate(zip(widths, depths, strict=True)):
            blocks = [BasicBlock(cin if j == 0 else w, w, 2 if i and j == 0 else 1) for j in range(n)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            cin = w
        self.fc = nn.Linear(cin, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        out: torch.Tensor = self.fc(x.mean((2, 3)))
        return out


class StagedResNet(nn.Module):
    """Stages kept as ``stages``, an ``nn.Sequential`` of ``nn.Sequential`` stages."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, 1, 1)
        self.stages = nn.Sequential(
            nn.Sequential(BasicBlock(4, 4, 1), BasicBlock(4, 4, 1)),
            nn.Sequential(BasicBlock(4, 8, 2), BasicBlock(8, 8, 1), BasicBlock(8, 8, 1)),
        )
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.stages(self.stem(x)).mean((2, 3)))
        return out


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x)
        return out


class MoELayer(nn.Module):
    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.experts[int(y.detach().sum().item()) % len(self.experts)](y)


class TinyMoE(nn.Module):
    """Two layers of eight experts: the layers are the blocks, not the experts."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, d)
        self.layers = nn.ModuleList(MoELayer(d, 8) for _ in range(2))
        self.head = nn.Linear(d, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out


class EncoderDecoder(nn.Module):
    """Two block lists of different classes and equal length: ambiguous."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.encoder_layers = nn.ModuleList(GPT2Block(d) for _ in range(2))
        self.decoder_layers = nn.ModuleList(LlamaDecoderLayer(d) for _ in range(2))


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], d: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block(d) for _ in range(n))


class DistilledSeq2Seq(nn.Module):
    """distilbart-12-6's shape: a decoder shallower than its encoder, each stack in its own submodule."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.encoder = Stack(GPT2Block, d, 3)
        self.decoder = Stack(LlamaDecoderLayer, d, 2)


class TitanLlama(nn.Module):
    """torchtitan's layout: ``layers`` is an ``nn.ModuleDict`` keyed "0", "1", ..., run in its order."""

    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(64, d)
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(d) for i in range(n)})
        self.norm = LlamaRMSNorm(d)
        self.output = nn.Linear(d, 64, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers.values():
            x = layer(x)[0]
        out: torch.Tensor = self.output(self.norm(x))
        return out


class SequentialMLPs(nn.Module):
    """Blocks written as ``nn.Sequential`` of torch's own layers, in an ``nn.ModuleList``."""

    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, d)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))
            for _ in range(n)
        )
        self.head = nn.Linear(d, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = x + layer(x)
        out: torch.Tensor = self.head(x)
        return out


# -- the tests ----------------------------------------------------------------


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def images(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (GPT2LMHeadModel, ["transformer.h.0", "transformer.h.1", "transformer.h.2"]),
        (LlamaForCausalLM, [f"model.layers.{i}" for i in range(4)]),
        (EncoderClassifier, [f"encoder.layers.{i}" for i in range(3)]),
        (ResNetLike, ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer4.0"]),
        (StagedResNet, ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1", "stages.1.2"]),
        (TinyMoE, ["layers.0", "layers.1"]),
        (TitanLlama, ["layers.0", "layers.1", "layers.2"]),
        (SequentialMLPs, ["layers.0", "layers.1", "layers.2"]),
        (
            DistilledSeq2Seq,
            ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2", "decoder.layers.0", "decoder.layers.1"],
        ),
    ],
)
def test_finds_the_blocks_of_common_model_shapes(make: type[nn.Module], expected: list[str]) -> None:
    model = make()
    h = client.attach(model)
    assert h.blocks == expected
    h.close()


@pytest.mark.parametrize(
    ("make", "inputs", "target"),
    [
        (GPT2LMHeadModel, tokens, "tokens"),
        (LlamaForCausalLM, tokens, "tokens"),
        (EncoderClassifier, tokens, "tokens"),
        (ResNetLike, images, "classes"),
        (TitanLlama, tokens, "tokens"),
        (SequentialMLPs, tokens, "tokens"),
    ],
)
def test_every_shape_trains_with_every_block_recomputed_and_equal_gradients(
    make: type[nn.Module], inputs: object, target: str
) -> None:
    """Every block pinned to full recomputation: keyword calls, tuple outputs, BatchNorm, dropout."""
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    model = make()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = client.attach(model, optimizer=opt)
    h.pin_modes(["recompute"] * len(h.blocks))
    assert callable(inputs)
    for step in range(3):
        x = inputs(step)
        y = torch.randint(0, 10 if target == "classes" else 64, (2,) if target == "classes" else (2, 12))
        grads = []
        for m, o in ((ref, opt_ref), (model, opt)):
            torch.manual_seed(100 + step)
            out = m(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
            grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
            o.step()
            o.zero_grad(set_to_none=True)
        assert len(grads[0]) == len(grads[1])
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b)
    assert h.modes == (Mode.RECOMPUTE,) * len(h.blocks), h.modes
    # Recomputation in backward must not update batch-norm statistics a second time.
    for (name, a), b in zip(ref.named_buffers(), model.buffers(), strict=True):
        assert torch.equal(a, b), name
    h.close()


def test_ambiguous_and_empty_discovery_say_what_they_saw_and_how_to_choose() -> None:
    with pytest.raises(client.BlockDiscoveryError) as err:
        client.attach(EncoderDecoder())
    text = str(err.value)
    assert "2 x GPT2Block in encoder_layers" in text and "2 x LlamaDecoderLayer in decoder_layers" in text
    assert "blocks=list(model.encoder_layers)" in text

    with pytest.raises(client.BlockDiscoveryError) as err:
        client.attach(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert "saw:" in str(err.value) and "blocks=" in str(err.value)


def test_explicit_blocks_across_two_lists_and_nesting_refused() -> None:
    model = EncoderDecoder()
    h = client.attach(model, blocks=[*model.encoder_layers, *model.decoder_layers])
    assert h.blocks == ["encoder_layers.0", "encoder_layers.1", "decoder_layers.0", "decoder_layers.1"]
    h.close()
    with pytest.raises(client.BlockDiscoveryError, match="inside"):
        client.attach(model, blocks=[model.encoder_layers[0], model.encoder_layers[0].mlp])
    with pytest.raises(client.BlockDiscoveryError, match=r"not an nn\.Module"):
        client.attach(model, blocks=["encoder_layers.0"])  # type: ignore[list-item]


def test_module_dict_stacks_take_their_values_and_errors_hint_as_much() -> None:
    model = TitanLlama()
    h = client.attach(model, blocks=model.layers)  # the ModuleDict itself: its values are the blocks
    assert h.blocks == ["layers.0", "layers.1", "layers.2"]
    h.close()
    with pytest.raises(client.BlockDiscoveryError, match=r"keys of the nn\.ModuleDict model\.layers") as err:
        client.attach(model, blocks=list(model.layers))  # type: ignore[arg-type]
    assert "blocks=list(model.layers.values())" in str(err.value)

    mixed = nn.Module()
    mixed.layers = nn.ModuleDict({"0": GPT2Block(8), "1": LlamaDecoderLayer(8)})
    with pytest.raises(client.BlockDiscoveryError) as err:
        client.attach(mixed)
    said = str(err.value)
    assert "layers (ModuleDict of 1 x GPT2Block, 1 x LlamaDecoderLayer)" in said, said
    assert "blocks=list(model.layers.values())" in said, said


def test_unlike_sequential_blocks_are_not_taken_and_the_error_names_them() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(
        [nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)), nn.Sequential(nn.Linear(4, 4), nn.ReLU())]
    )
    with pytest.raises(client.BlockDiscoveryError) as err:
        client.attach(model)
    said = str(err.value)
    assert "Sequential(Linear, GELU, Linear)" in said and "Sequential(Linear, ReLU)" in said, said
    assert "no nn.ModuleList" not in said and "blocks=list(model.layers)" in said, said
    # Alike in classes, not in widths: still not one kind of block.
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, w), nn.GELU()) for w in (8, 16))
    with pytest.raises(client.BlockDiscoveryError, match=r"2 x Sequential\(Linear, GELU\), unlike"):
        client.attach(model)
    with pytest.raises(client.BlockDiscoveryError, match=r"saw: no nn\.ModuleList, nn\.Sequential or nn\.ModuleDict"):
        client.attach(nn.Linear(2, 2))
