"""Hugging Face architectures from tiny configs, each through partc end to end: does every model
family users bring compile, verify, train and check?

For each architecture it writes a model file (a tiny config, random weights, nothing
downloaded) and runs, as a user would, from a fresh profile cache:

    partc compile MODEL -b 8 [--stages 2 | the --mode's flags] -o DIR   (priced as compile prices
                                                                         it: measured here)
    partc verify DIR        partc launch DIR --steps 2        partc check DIR

Modes (`--modes`, repeatable; each a row per architecture):

- `cpu`: 2 stages on this machine's `cpu` cluster, fp32 (the default compile);
- `bf16`: the same at `--precision bf16-mixed`;
- `meta`: the model built under `torch.device("meta")` (never materialised at capture; profile,
  verify and launch initialise it), for the architectures that list it;
- `cpu4`: 4 stages on `cpu-4` (4 processes on this machine's cores);
- `gpu`: compile and check only, for the analytic 8 x H200 cluster at bf16-mixed and batch 64
  (no device needed: a GPU plan's capture, pricing and emit).

A step that fails prints its last stderr line; the report is a table of exit codes (0 each,
or the failing step's) and the run's wall time per row. Exit status 1 when any row failed.
The transformers version matters (the MoE layers' operators, the masks' dtypes): it is printed.

    .venv/bin/python bench/model_zoo.py [--models llama,mixtral] [--modes cpu,bf16,meta,cpu4,gpu]
        [--json out.json] [--keep DIR]

About 45 s a row on this 2-core VM (the measured profile with a busy neighbour dominates);
the default set (all models x cpu, the bf16/meta/cpu4 subsets, gpu for all: 129 rows for 53
architectures) about 95 min (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARTC = str(Path(sys.executable).parent / "partc")

_MODEL_FILE = '''"""HF {cls} DOC"""
import torch
from transformers import {cfg}, {cls}
CONSTS

def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = {cfg}({kw})
    {build}


def example_inputs(batch_size: int):
    return INPUTS
'''


def _model_file(doc: str, inputs: str, consts: str = "") -> str:
    """A family's model file template: what differs between families is the docstring, the
    module's constants and what `example_inputs` returns; the placeholders left (`{cls}`,
    `{res}`...) are an `Arch`'s to fill."""
    return (_MODEL_FILE.replace("DOC", doc).replace("CONSTS", consts)
            .replace("INPUTS", inputs))


_LM = _model_file("from a tiny config (random weights).",
                  "(torch.randint(0, VOCAB, (batch_size, SEQ)),)", "\nVOCAB = 256\nSEQ = 32\n")
_VISION = _model_file("from a tiny config (random weights).",
                      "(torch.randn(batch_size, 3, {res}, {res}),)")
_SEQ2SEQ = _model_file("(encoder-decoder) from a tiny config (random weights).",
                       '{{"{first}": {first_value},\n'
                       '             "decoder_input_ids": '
                       'torch.randint(3, VOCAB, (batch_size, 16))}}',
                       "\nVOCAB = 256\n")
_CLIP = _model_file("(two towers, returning its contrastive loss) from a tiny config.",
                    '{{"input_ids": torch.randint(0, VOCAB, (batch_size, 16)),\n'
                    '             "pixel_values": torch.randn(batch_size, 3, 32, 32), '
                    '"return_loss": True}}', "\nVOCAB = 256\n")
_AUDIO = _model_file("(raw waveform in, CTC logits out) from a tiny config (random weights).",
                     "(torch.randn(batch_size, 1600),)")

_DECODER = ("num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, "
            "max_position_embeddings=64, use_cache=False")


@dataclass(frozen=True)
class Arch:
    """One architecture: its model file's template, config class, model class and config."""

    name: str
    template: str
    cfg: str
    cls: str
    kw: str
    extra: dict[str, str] = field(default_factory=dict)
    meta: bool = False  # also run built on the meta device
    modes: tuple[str, ...] = ("cpu", "gpu")  # beyond --modes' defaults

    def source(self, on_meta: bool) -> str:
        build = (f'with torch.device("meta"):\n        return {self.cls}(config)' if on_meta
                 else f"return {self.cls}(config)")
        return self.template.format(cfg=self.cfg, cls=self.cls, kw=self.kw, build=build,
                                    **self.extra)


_H = "vocab_size=VOCAB, hidden_size=64, intermediate_size=128, "
ARCHS: tuple[Arch, ...] = (
    Arch("llama", _LM, "LlamaConfig", "LlamaForCausalLM", _H + _DECODER, meta=True,
         modes=("cpu", "bf16", "gpu")),
    Arch("llama_tied", _LM, "LlamaConfig", "LlamaForCausalLM",
         _H + _DECODER + ", tie_word_embeddings=True", modes=("cpu", "cpu4", "gpu")),
    Arch("mistral", _LM, "MistralConfig", "MistralForCausalLM",
         _H + _DECODER + ", sliding_window=16"),
    Arch("qwen2", _LM, "Qwen2Config", "Qwen2ForCausalLM", _H + _DECODER),
    Arch("qwen3", _LM, "Qwen3Config", "Qwen3ForCausalLM", _H + _DECODER + ", head_dim=16"),
    Arch("gemma2", _LM, "Gemma2Config", "Gemma2ForCausalLM",
         _H + _DECODER + ", head_dim=16, sliding_window=16", meta=True,
         modes=("cpu", "bf16", "cpu4", "gpu")),
    Arch("gemma3", _LM, "Gemma3TextConfig", "Gemma3ForCausalLM",
         _H + _DECODER + ", head_dim=16, sliding_window=16"),
    Arch("phi3", _LM, "Phi3Config", "Phi3ForCausalLM",
         _H + "num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, "
         "max_position_embeddings=64, pad_token_id=0, use_cache=False"),
    Arch("olmo2", _LM, "Olmo2Config", "Olmo2ForCausalLM", _H + _DECODER + ", pad_token_id=0"),
    Arch("starcoder2", _LM, "Starcoder2Config", "Starcoder2ForCausalLM", _H + _DECODER),
    Arch("gpt_neox", _LM, "GPTNeoXConfig", "GPTNeoXForCausalLM",
         _H + "num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64, "
         "use_cache=False"),
    Arch("opt", _LM, "OPTConfig", "OPTForCausalLM",
         "vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=4, "
         "num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64, "
         "use_cache=False"),
    Arch("bloom", _LM, "BloomConfig", "BloomForCausalLM",
         "vocab_size=VOCAB, hidden_size=64, n_layer=4, n_head=4, use_cache=False"),
    Arch("falcon", _LM, "FalconConfig", "FalconForCausalLM",
         "vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, "
         "use_cache=False"),
    Arch("gptj", _LM, "GPTJConfig", "GPTJForCausalLM",
         "vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, rotary_dim=8, n_positions=64, "
         "use_cache=False"),
    Arch("phi", _LM, "PhiConfig", "PhiForCausalLM",
         _H + "num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64, "
         "use_cache=False"),
    Arch("stablelm", _LM, "StableLmConfig", "StableLmForCausalLM", _H + _DECODER),
    Arch("granite", _LM, "GraniteConfig", "GraniteForCausalLM", _H + _DECODER),
    Arch("cohere", _LM, "CohereConfig", "CohereForCausalLM", _H + _DECODER),
    Arch("gpt_bigcode", _LM, "GPTBigCodeConfig", "GPTBigCodeForCausalLM",
         "vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64, multi_query=True, "
         "use_cache=False"),
    Arch("codegen", _LM, "CodeGenConfig", "CodeGenForCausalLM",
         "vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, rotary_dim=8, n_positions=64, "
         "n_ctx=64, use_cache=False"),
    Arch("mamba", _LM, "MambaConfig", "MambaForCausalLM",
         "vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=4, use_cache=False"),
    # mixture of experts: transformers' grouped-matmul operator (a torch.library custom op).
    # Not `meta`: built on meta its router takes a path with an integer histc that only CUDA
    # runs, which compile here refuses in one line (tests/test_bad_inputs.py has the case)
    Arch("mixtral", _LM, "MixtralConfig", "MixtralForCausalLM",
         _H + _DECODER + ", num_local_experts=4, num_experts_per_tok=2",
         modes=("cpu", "bf16", "cpu4", "gpu")),
    Arch("qwen2_moe", _LM, "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
         _H + _DECODER + ", moe_intermediate_size=32, shared_expert_intermediate_size=64, "
         "num_experts=4, num_experts_per_tok=2"),
    Arch("qwen3_moe", _LM, "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         _H + _DECODER + ", head_dim=16, moe_intermediate_size=32, num_experts=4, "
         "num_experts_per_tok=2"),
    Arch("deepseek_v3", _LM, "DeepseekV3Config", "DeepseekV3ForCausalLM",
         _H + "moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, "
         "n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, "
         "num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, "
         "kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, "
         "max_position_embeddings=64, use_cache=False", modes=("cpu", "cpu4", "gpu")),
    # attention, Mamba and MoE layers interleaved (its Python scan: no CUDA kernels here)
    Arch("jamba", _LM, "JambaConfig", "JambaForCausalLM",
         _H + "num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, "
         "num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1, "
         "attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, "
         "mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False, use_cache=False"),
    # encoders
    Arch("roberta", _LM, "RobertaConfig", "RobertaForMaskedLM",
         _H + "num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64"),
    Arch("xlm_roberta", _LM, "XLMRobertaConfig", "XLMRobertaForSequenceClassification",
         _H + "num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64, "
         "num_labels=3"),
    Arch("albert", _LM, "AlbertConfig", "AlbertForMaskedLM",
         _H + "embedding_size=32, num_hidden_layers=4, num_attention_heads=4, "
         "max_position_embeddings=64", meta=True, modes=("cpu", "bf16", "gpu")),
    Arch("distilbert", _LM, "DistilBertConfig", "DistilBertForMaskedLM",
         "vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=4, n_heads=4, "
         "max_position_embeddings=64"),
    Arch("electra", _LM, "ElectraConfig", "ElectraForMaskedLM",
         _H + "embedding_size=32, num_hidden_layers=4, num_attention_heads=4, "
         "max_position_embeddings=64"),
    # finfo(float32).min mask fills under bf16-mixed
    Arch("deberta_v2", _LM, "DebertaV2Config", "DebertaV2ForMaskedLM",
         _H + "num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64",
         meta=True, modes=("cpu", "bf16", "gpu")),
    Arch("modernbert", _LM, "ModernBertConfig", "ModernBertForMaskedLM",
         _H + "num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64, "
         "local_attention=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, "
         "sep_token_id=2"),
    Arch("funnel", _LM, "FunnelConfig", "FunnelForMaskedLM",
         "vocab_size=VOCAB, d_model=64, n_head=4, d_head=16, d_inner=128, block_sizes=[1, 1, 1]"),
    Arch("mpnet", _LM, "MPNetConfig", "MPNetForMaskedLM",
         _H + "num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64"),
    Arch("xlnet", _LM, "XLNetConfig", "XLNetLMHeadModel",
         "vocab_size=VOCAB, d_model=64, n_layer=4, n_head=4, d_inner=128, use_mems_train=False"),
    # vision
    Arch("vit", _VISION, "ViTConfig", "ViTForImageClassification",
         "hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, "
         "image_size=32, patch_size=8, num_labels=10", {"res": "32"}, meta=True,
         modes=("cpu", "bf16", "gpu")),
    Arch("swin", _VISION, "SwinConfig", "SwinForImageClassification",
         "image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 2, 1], "
         "num_heads=[1, 2, 2, 4], window_size=2, num_labels=10", {"res": "64"}, meta=True,
         modes=("cpu", "cpu4", "gpu")),
    Arch("convnext", _VISION, "ConvNextConfig", "ConvNextForImageClassification",
         "hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10", {"res": "64"},
         modes=("cpu", "bf16", "gpu")),
    Arch("mobilenet_v2", _VISION, "MobileNetV2Config", "MobileNetV2ForImageClassification",
         "image_size=32, depth_multiplier=0.35, num_labels=10", {"res": "32"}),
    Arch("deit", _VISION, "DeiTConfig", "DeiTForImageClassification",
         "hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, "
         "image_size=32, patch_size=8, num_labels=10", {"res": "32"}),
    Arch("beit", _VISION, "BeitConfig", "BeitForImageClassification",
         "hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, "
         "image_size=32, patch_size=8, num_labels=10, use_relative_position_bias=True",
         {"res": "32"}),
    Arch("dinov2", _VISION, "Dinov2Config", "Dinov2ForImageClassification",
         "hidden_size=64, num_hidden_layers=4, num_attention_heads=4, image_size=32, "
         "patch_size=8, num_labels=10", {"res": "32"}),
    Arch("resnet", _VISION, "ResNetConfig", "ResNetForImageClassification",
         "embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10",
         {"res": "64"}),
    Arch("regnet", _VISION, "RegNetConfig", "RegNetForImageClassification",
         "embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], "
         "groups_width=8, num_labels=10", {"res": "64"}),
    # dense prediction: logits per pixel (batch, classes, h/4, w/4)
    Arch("segformer", _VISION, "SegformerConfig", "SegformerForSemanticSegmentation",
         "num_encoder_blocks=4, depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], "
         "num_attention_heads=[1, 2, 2, 4], decoder_hidden_size=64, num_labels=5",
         {"res": "64"}),
    # audio: a convolutional feature encoder on the waveform, a weight-normed positional conv.
    # LayerDrop off (in training it branches on a random tensor, which torch.export refuses;
    # compile names the line) and SpecAugment off (its masks are drawn with numpy while
    # capturing, so the plan would hold one mask for every step; verify fails on it)
    Arch("wav2vec2", _AUDIO, "Wav2Vec2Config", "Wav2Vec2ForCTC",
         "vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, "
         "intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), "
         "num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=0.0, "
         "mask_time_prob=0.0"),
    # two towers, the model's own loss
    Arch("clip", _CLIP, "CLIPConfig", "CLIPModel",
         "text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, "
         "num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32), "
         "vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, "
         "num_attention_heads=4, image_size=32, patch_size=8), projection_dim=16"),
    Arch("siglip", _CLIP, "SiglipConfig", "SiglipModel",
         "text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, "
         "num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16), "
         "vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, "
         "num_attention_heads=4, image_size=32, patch_size=8)"),
    # encoder-decoders
    Arch("t5", _SEQ2SEQ, "T5Config", "T5ForConditionalGeneration",
         "vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3, "
         "num_heads=4, use_cache=False",
         {"first": "input_ids", "first_value": "torch.randint(3, VOCAB, (batch_size, 24))"},
         meta=True, modes=("cpu", "bf16", "cpu4", "gpu")),
    Arch("bart", _SEQ2SEQ, "BartConfig", "BartForConditionalGeneration",
         "vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, "
         "encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, "
         "decoder_ffn_dim=128, max_position_embeddings=64, use_cache=False",
         {"first": "input_ids", "first_value": "torch.randint(3, VOCAB, (batch_size, 24))"},
         modes=("cpu", "cpu4", "gpu")),
    Arch("whisper", _SEQ2SEQ, "WhisperConfig", "WhisperForConditionalGeneration",
         "vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2, "
         "encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, "
         "decoder_ffn_dim=128, max_source_positions=32, max_target_positions=32, "
         "use_cache=False, pad_token_id=0, decoder_start_token_id=1",
         {"first": "input_features", "first_value": "torch.randn(batch_size, 16, 64)"},
         modes=("cpu", "cpu4", "gpu")),
)

MODES: dict[str, tuple[str, ...]] = {
    "cpu": ("-b", "8", "--stages", "2"),
    "bf16": ("-b", "8", "--stages", "2", "--precision", "bf16-mixed"),
    "meta": ("-b", "8", "--stages", "2"),
    "cpu4": ("-b", "8", "--stages", "4", "--cluster", "cpu-4"),
    "gpu": ("-b", "64", "--cluster", "8xh200-141gb", "--precision", "bf16-mixed"),
}


@dataclass
class Row:
    model: str
    mode: str
    steps: dict[str, int] = field(default_factory=dict)  # command -> exit status
    failure: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.steps) and not any(self.steps.values())


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else ""


_VERDICTS = ("STALE", "TAMPERED", "FAIL")


def failure_line(proc: subprocess.CompletedProcess[str]) -> str:
    """Why a step failed: partc's error line, else the verdict a report printed on stdout
    (`check`'s STALE or TAMPERED, verify's FAIL), else the last line of either stream (a
    progress line when a command died)."""
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("partc: error:")]
    if errors:
        return errors[-1].strip()[:300]
    verdicts = [ln for ln in proc.stdout.splitlines() if any(v in ln for v in _VERDICTS)]
    if verdicts:
        return verdicts[0].strip()[:300]
    return last_line(proc.stderr) or last_line(proc.stdout)


def run_row(arch: Arch, mode: str, work: Path, env: dict[str, str]) -> Row:
    """Write the model file and run the mode's commands, stopping at the first failure."""
    row = Row(arch.name, mode)
    model = work / f"hf_{arch.name}{'_meta' if mode == 'meta' else ''}.py"
    model.write_text(arch.source(on_meta=mode == "meta"))
    plan = work / f"{arch.name}-{mode}"
    commands: list[tuple[str, list[str]]] = [
        ("compile", ["compile", str(model), *MODES[mode], "-o", str(plan)])]
    if mode != "gpu":
        commands += [("verify", ["verify", str(plan)]),
                     ("launch", ["launch", str(plan), "--steps", "2"])]
    commands.append(("check", ["check", str(plan)]))
    start = time.perf_counter()
    for name, args in commands:
        proc = subprocess.run([PARTC, *args], capture_output=True, text=True, env=env, cwd=work,
                              timeout=1800)
        row.steps[name] = proc.returncode
        if proc.returncode != 0:
            row.failure = f"{name}: {failure_line(proc)}"
            break
    row.seconds = time.perf_counter() - start
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated architecture names (default: all)")
    parser.add_argument("--modes", default="cpu,bf16,meta,cpu4,gpu",
                        help="comma-separated modes (each architecture runs those it lists)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="keep the model files and plans here")
    args = parser.parse_args(argv)
    by_name = {a.name: a for a in ARCHS}
    names = args.models.split(",") if args.models else list(by_name)
    unknown = [n for n in names if n not in by_name]
    modes = args.modes.split(",")
    if unknown or any(m not in MODES for m in modes):
        parser.error(f"unknown model(s) {unknown} or mode(s) {modes}: models {sorted(by_name)}, "
                     f"modes {sorted(MODES)}")
    import transformers

    work = args.keep or Path(tempfile.mkdtemp(prefix="partc-zoo-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_CACHE_DIR": str(work / "cache")}
    print(f"transformers {transformers.__version__}; work in {work}", flush=True)
    rows: list[Row] = []
    began = time.perf_counter()
    try:
        for name in names:
            arch = by_name[name]
            for mode in modes:
                if (mode == "meta" and not arch.meta) or (mode != "meta" and
                                                          mode not in arch.modes):
                    continue
                row = run_row(arch, mode, work, env)
                rows.append(row)
                status = "ok" if row.ok else f"FAILED {row.failure}"
                print(f"{name:14s} {mode:5s} {row.seconds:6.1f} s  {status}", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    failed = [r for r in rows if not r.ok]
    print("\n| model | mode | compile | verify | launch | check | s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(str(r.steps.get(c, "-")) for c in ("compile", "verify", "launch",
                                                              "check"))
        print(f"| {r.model} | {r.mode} | {cells} | {r.seconds:.0f} |")
    print(f"\n{len(rows) - len(failed)} of {len(rows)} rows passed in "
          f"{(time.perf_counter() - began) / 60:.1f} min")
    for r in failed:
        print(f"FAILED {r.model} {r.mode}: {r.failure}")
    if args.json:
        doc: dict[str, Any] = {"transformers": transformers.__version__,
                               "rows": [r.__dict__ | {"ok": r.ok} for r in rows]}
        args.json.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
