"""fxshard on models it was not built around: timm's ViT and ResNet, and a
peft LoRA on a transformers Llama, each against the unsharded reference
(tests/parity.py) at 2 gloo ranks under the default options.

    pip install timm peft   # timm needs the torchvision of your torch
    PYTHONPATH=. python bench/scripts/third_party_models.py timm_vit_aot,timm_resnet_aot,peft_lora_llama
"""

import sys

import torch

from tests.distributed import run_ranks
from tests.parity import Scenario, train_and_compare


def vit():
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=5, drop_rate=0.0
    )


def resnet():
    import timm

    m = timm.create_model("resnet18", pretrained=False, num_classes=5)
    return m


def lora_llama():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    base = LlamaForCausalLM(cfg)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def lora_frozen() -> tuple[str, ...]:
    """The base model's parameter names: what peft freezes (the harness sets
    requires_grad from Scenario.freeze, so it must name them)."""
    return tuple(n for n, _ in lora_llama().named_parameters() if "lora_" not in n)


def images(g):
    return torch.randn(2, 3, 32, 32, generator=g)


def ce(out, x):
    return out.float().pow(2).mean()


def tokens(g):
    ids = torch.randint(0, 64, (2, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


SC = {
    "timm_vit": Scenario(make_model=vit, make_batch=images, loss=ce, steps=2),
    "timm_vit_aot": Scenario(
        make_model=vit, make_batch=images, loss=ce, steps=2, compile_kwargs=dict(backend="aot_eager")
    ),
    "timm_resnet_aot": Scenario(
        make_model=resnet, make_batch=images, loss=ce, steps=2, compile_kwargs=dict(backend="aot_eager")
    ),
    "peft_lora_llama_aot": Scenario(
        make_model=lora_llama,
        make_batch=tokens,
        loss=lambda out, b: out.loss,
        steps=2,
        compile_kwargs=dict(backend="aot_eager"),
        freeze=lora_frozen(),
    ),
    "peft_lora_llama": Scenario(
        make_model=lora_llama, make_batch=tokens, loss=lambda out, b: out.loss, steps=2, freeze=lora_frozen()
    ),
}


def run(rank, ws, names):
    import traceback

    out = {}
    for n in names:
        try:
            m = train_and_compare(rank, ws, SC[n])["model"]
            placements = [p.placement.value for p in m.fxshard_plan.params]
            out[n] = (f"OK sequenced={m.fxshard_plan.sequenced} reason={m.fxshard_plan.graph_break_reason} "
                      f"replicated={placements.count('Replicate()')} sharded={placements.count('Shard(0)')}")  # fmt: skip
        except Exception:
            out[n] = traceback.format_exc()[-1500:]
        torch._dynamo.reset()
    return out


if __name__ == "__main__":
    res = run_ranks(2, run, sys.argv[1].split(","), timeout=1200)
    for r, x in enumerate(res):
        if "__error__" in x:
            print(r, x["__error__"][-2000:])
            continue
        for k, v in x.items():
            print(r, k, v)
