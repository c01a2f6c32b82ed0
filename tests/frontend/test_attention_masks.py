"""partc.frontend.attention_masks on real torch.export programs of real HF models: constant masks
that mask nothing or only the future are dropped (with is_causal for the latter), the program
computes bit for bit what it did, and every other mask is left alone."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import EXAMPLES
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from partc.frontend.attention_masks import SDPA, simplify_attention_masks
from partc.frontend.export import capture
from partc.frontend.model_file import load_model_file

VOCAB, SEQ = 128, 16


def hf_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":  # dropout off: outputs compared bit for bit
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2,
                                          n_positions=64, use_cache=False, attn_pdrop=0.0,
                                          resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0))
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64,
                                            intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2,
                                            use_cache=False, bos_token_id=0, eos_token_id=0,
                                            pad_token_id=0))
    assert name == "bert"
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=128,
                                      max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def sdpa_calls(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.target is SDPA]


def mask_of(node: torch.fx.Node) -> object:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def causal_of(node: torch.fx.Node) -> bool:
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))


@pytest.mark.parametrize("name, causal", [("gpt2", True), ("llama", True), ("bert", False)])
def test_hf_masks_become_none_or_causal_and_outputs_do_not_change(name: str,
                                                                   causal: bool) -> None:
    model = hf_model(name).train()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    program = torch.export.export(model, (), {"input_ids": ids})
    calls = sdpa_calls(program)
    assert calls and all(isinstance(mask_of(n), torch.fx.Node) for n in calls)  # materialised
    before = program.module()(input_ids=ids).logits
    simplify_attention_masks(program)
    calls = sdpa_calls(program)
    assert len(calls) == 2
    assert all(mask_of(n) is None and causal_of(n) == causal for n in calls)
    # the mask's computation is gone: no bool tensor is left in the graph
    assert not [n for n in program.graph.nodes if n.op == "call_function"
                and getattr(n.meta.get("val"), "dtype", None) == torch.bool]
    after = program.module()(input_ids=ids).logits
    assert torch.equal(before, after)
    # and so are the gradients
    module = program.module()
    module(input_ids=ids).logits.square().sum().backward()
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)


class ConstantMask(torch.nn.Module):
    """Attention under a mask made of literals only (`kind`), or taken from an input."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self.proj(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        s = x.shape[1]
        if self.kind == "input":
            m = mask
        elif self.kind == "strict-lower":  # the diagonal masked too: not the causal pattern
            m = torch.ones(s, s, dtype=torch.bool, device=x.device).tril(-1)
            m[0, 0] = True
        elif self.kind == "window":  # sliding window of 2
            i = torch.arange(s, device=x.device)
            m = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 2)
        elif self.kind == "float-causal":
            m = torch.full((s, s), -math.inf, device=x.device).triu(1)
        elif self.kind == "float-min-causal":  # finfo.min, not -inf: left as it is
            m = torch.full((s, s), torch.finfo(torch.float32).min, device=x.device).triu(1)
        elif self.kind == "random":
            m = torch.rand(s, s, device=x.device) > 0.5
        else:
            raise AssertionError(self.kind)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=m)


@pytest.mark.parametrize("kind, rewritten", [
    ("input", False), ("strict-lower", False), ("window", False), ("float-causal", True),
    ("float-min-causal", False), ("random", False)])
def test_only_provably_trivial_or_causal_constant_masks_are_rewritten(kind: str,
                                                                      rewritten: bool) -> None:
    torch.manual_seed(0)
    model = ConstantMask(kind)
    x = torch.randn(2, 6, 8)
    kwargs = {"mask": torch.ones(6, 6, dtype=torch.bool)} if kind == "input" else {}
    program = torch.export.export(model, (x,), kwargs)
    torch.manual_seed(3)
    before = program.module()(x, **kwargs)
    simplify_attention_masks(program)
    [call] = sdpa_calls(program)
    assert (mask_of(call) is None) == rewritten
    assert causal_of(call) == rewritten
    torch.manual_seed(3)
    after = program.module()(x, **kwargs)
    if kind != "random":
        assert torch.equal(before, after)


def test_a_meta_model_is_rewritten_from_its_mask_computed_on_the_cpu() -> None:
    with torch.device("meta"):
        model = hf_model("llama").train()
    ids = torch.zeros(2, SEQ, dtype=torch.long, device="meta")
    program = torch.export.export(model, (), {"input_ids": ids})
    simplify_attention_masks(program)
    assert all(mask_of(n) is None and causal_of(n) for n in sdpa_calls(program))


def test_capture_applies_it() -> None:
    """Every program partc exports (capture, the micro-batch re-export, profiling) goes through
    export_program, which runs the pass: the GPT-2 example's attention is causal, unmasked."""
    cap = capture(load_model_file(EXAMPLES / "gpt2.py"), 2)
    for program in (cap.exported, cap.scaled):
        assert program is not None
        calls = sdpa_calls(program)
        assert calls and all(mask_of(n) is None and causal_of(n) for n in calls)
