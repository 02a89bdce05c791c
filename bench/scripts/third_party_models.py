"""fxshard on other people's models: timm (ViT, ResNet with BatchNorm, ConvNeXt,
EfficientNet, MobileNetV3) and peft LoRA on a transformers Llama, against the
unsharded reference of tests/helpers/parity.py (train_and_compare, Scenario).

timm and peft are not test dependencies: install them beside fxshard's
environment without letting pip replace torch (a venv with
--system-site-packages, then `pip install timm peft`; put back the CPU torch
if pip pulled another), then, from the repository's root:

    PYTHONPATH=. python bench/scripts/third_party_models.py WS CASE[,CASE...]
    (CASE may be a group name: see GROUPS; `list` prints the cases)

Every comparison the harness makes goes through parity._close, wrapped here to
record the largest differences:
  loss  |a-e| / |e|
  grad  per step, max over tensors of max|a-e|, divided by the largest |e| of any gradient that step
        (gradtensor: the worst per-tensor max|a-e| / max|e|)
  param per tensor max|a-e| / max|e| at elements whose reference gradient was ever nonzero
        (param_grad_floor=0.0)
The harness's own verdict (its atol/rtol) is kept as `mismatches` (run with a
list, so every rank finishes and no collective is left waiting).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch
import torch.distributed as dist

import fxshard
from tests.helpers import parity
from tests.helpers.distributed import run_ranks
from tests.helpers.parity import Scenario, train_and_compare

BF16 = dict(atol=3e-2, rtol=3e-2, outlier_fraction=0.01)
MP = fxshard.MixedPrecision(torch.bfloat16, torch.float32)

# ---------------------------------------------------------------- models


def vit():
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=5, drop_rate=0.0
    )


def resnet():
    import timm

    return timm.create_model("resnet18", pretrained=False, num_classes=5)


def convnext():
    import timm

    return timm.create_model("convnext_atto", pretrained=False, num_classes=5, drop_path_rate=0.0)


def effnet():
    import timm

    return timm.create_model("efficientnet_b0", pretrained=False, num_classes=5, drop_rate=0.0, drop_path_rate=0.0)


def mobilenet():
    import timm

    return timm.create_model(
        "mobilenetv3_small_100", pretrained=False, num_classes=5, drop_rate=0.0, drop_path_rate=0.0
    )


VOCAB = 64


def llama(tie=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg)


def lora(tie=True, targets=("q_proj", "v_proj", "down_proj"), save=None):
    def make():
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=list(targets),
            lora_dropout=0.0,
            modules_to_save=list(save) if save else None,
        )
        return get_peft_model(llama(tie), cfg)

    return make


def frozen_names(make) -> tuple[str, ...]:
    """What peft froze (the harness sets requires_grad from Scenario.freeze by prefix)."""
    torch.manual_seed(0)
    return tuple(n for n, p in make().named_parameters() if not p.requires_grad)


# ---------------------------------------------------------------- batches and losses


def images(g):
    return torch.randn(4, 3, 32, 32, generator=g)


def images64(g):
    return torch.randn(8, 3, 64, 64, generator=g)


def sq(out, x):
    return out.float().pow(2).mean()


def tokens(g):
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def hf_loss(out, b):
    return out.loss


# ---------------------------------------------------------------- recording the harness's comparisons


class Rec:
    def __init__(self):
        self.loss = 0.0
        self.grad_step: dict[int, list[float]] = {}  # step -> [max diff, max |e|]
        self.gradtensor = (0.0, "")
        self.param = (0.0, "")
        self.clip = 0.0
        self.n = 0

    def add(self, a, e, what):
        self.n += 1
        a, e = a.detach().double().cpu(), e.detach().double().cpu()
        if a.numel() == 0:
            return
        d = (a - e).abs().max().item()
        s = e.abs().max().item()
        if what.endswith(" loss"):
            self.loss = max(self.loss, d / max(s, 1e-30))
        elif " grad of " in what:
            step = int(what.split()[1])
            cur = self.grad_step.setdefault(step, [0.0, 0.0])
            cur[0], cur[1] = max(cur[0], d), max(cur[1], s)
            r = d / s if s > 0 else (0.0 if d == 0 else float("inf"))
            if r > self.gradtensor[0]:
                self.gradtensor = (r, what)
        elif what.startswith("param "):
            r = d / s if s > 0 else (0.0 if d == 0 else float("inf"))
            if r > self.param[0]:
                self.param = (r, what)
        elif "clip_grad_norm_" in what:
            self.clip = max(self.clip, d / max(s, 1e-30))

    def summary(self):
        grad = max((d / s if s else 0.0) for d, s in self.grad_step.values()) if self.grad_step else 0.0
        return dict(
            gmax=max((s for d, s in self.grad_step.values()), default=0.0),
            loss=self.loss,
            grad=grad,
            gradtensor=self.gradtensor[0],
            gradtensor_at=self.gradtensor[1],
            param=self.param[0],
            param_at=self.param[1],
        )


class State:
    rec: Rec | None = None
    ref = None
    rank = 0
    ws = 1
    track_buffers = False
    ref_calls = 0
    shadow: dict | None = None
    ref_compile = False


_orig_close, _orig_reference, _orig_step_loss = parity._close, parity._reference, parity._step_loss


def _close(actual, expected, what, sc):
    if State.rec is not None:
        try:
            State.rec.add(actual, expected, what)
        except Exception:
            pass
    return _orig_close(actual, expected, what, sc)


def _reference(sc):
    ref = _orig_reference(sc)
    State.ref = ref
    if State.ref_compile:  # the reference itself under torch.compile (same backend): what the compiler alone does
        ref.compile(backend=sc.compile_kwargs.get("backend", "inductor"))
    return ref


def _step_loss(model, batches, sc):
    """For BatchNorm: the reference runs every rank's batches through one
    module; running statistics are per rank (no SyncBN), so keep a shadow copy
    of the buffers that sees this rank's batches only."""
    if not (State.track_buffers and model is State.ref):
        return _orig_step_loss(model, batches, sc)
    ref = State.ref
    slots = [(mod, k) for mod in ref.modules() for k, b in mod._buffers.items() if b is not None]
    if State.shadow is None:
        State.shadow = {(id(mod), k): mod._buffers[k].detach().clone() for mod, k in slots}
        State.initial = {key: t.clone() for key, t in State.shadow.items()}
        State.buffer_names = {
            (id(mod), k): f"{mn}.{k}".lstrip(".")
            for mn, mod in ref.named_modules()
            for k, b in mod._buffers.items()
            if b is not None
        }
    idx = State.ref_calls
    State.ref_calls += 1
    if idx % State.ws != State.rank:
        return _orig_step_loss(model, batches, sc)
    # swap tensor objects, never write in place: batch norm's backward saves its running statistics
    saved = {(id(mod), k): mod._buffers[k] for mod, k in slots}
    for mod, k in slots:
        mod._buffers[k] = State.shadow[(id(mod), k)]
    try:
        return _orig_step_loss(model, batches, sc)
    finally:
        for mod, k in slots:
            State.shadow[(id(mod), k)] = mod._buffers[k]
            mod._buffers[k] = saved[(id(mod), k)]


parity._close, parity._reference, parity._step_loss = _close, _reference, _step_loss


def rel(a, e):
    a, e = a.detach().double().cpu(), e.detach().double().cpu()
    if a.shape != e.shape:
        return float("inf")
    s = e.abs().max().item() if e.numel() else 0.0
    d = (a - e).abs().max().item() if e.numel() else 0.0
    return d / s if s else d


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---------------------------------------------------------------- checks after training


def check_buffers(rank, ws, model, ref, sc):
    """Running statistics after the steps, and an eval-mode forward on them."""
    out = {}
    shadow = {State.buffer_names[key]: t for key, t in (State.shadow or {}).items()}
    worst, at = 0.0, ""
    for n, b in model.named_buffers():
        if n not in shadow:
            out.setdefault("missing", []).append(n)
            continue
        r = rel(b, shadow[n])
        if r > worst:
            worst, at = r, n
    out["buffers"] = worst
    initial = {State.buffer_names[key]: t for key, t in State.initial.items()}
    out["moved_from_init"] = max(rel(b, initial[n]) for n, b in model.named_buffers() if b.is_floating_point())
    out["buffers_at"] = at
    out["n_buffers"] = len(shadow)
    x = sc.make_batch(torch.Generator().manual_seed(777))
    with torch.no_grad():
        for mn, mod in ref.named_modules():
            for k in list(mod._buffers):
                if mod._buffers[k] is not None:
                    mod._buffers[k] = shadow[f"{mn}.{k}".lstrip(".")]
        model.eval()
        ref.eval()
        y, yr = model(x), ref(x)
        model.train()
        ref.train()
    out["eval_out"] = rel(y, yr)
    return out


def check_merge_generate(rank, ws, model, ref, sc):
    out = {}
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        before, rbefore = model(input_ids=ids).logits.float(), ref(input_ids=ids).logits.float()
    out["unmerged_logits"] = rel(before, rbefore)
    model.merge_adapter()
    ref.merge_adapter()
    with torch.no_grad():
        after, rafter = model(input_ids=ids).logits.float(), ref(input_ids=ids).logits.float()
    out["merged_logits"] = rel(after, rafter)
    out["merged_vs_unmerged"] = rel(after, before)
    refp = dict(ref.named_parameters())
    worst, at = 0.0, ""
    for n, p in model.named_parameters():
        if "base_layer" in n:
            r = rel(full(p), refp[n])
            if r > worst:
                worst, at = r, n
    out["merged_weights"], out["merged_weights_at"] = worst, at
    model.unmerge_adapter()
    ref.unmerge_adapter()
    with torch.no_grad():
        again = model(input_ids=ids).logits.float()
    out["unmerge_roundtrip"] = rel(again, before)
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    gen, rgen = model.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw)
    out["generate_equal"] = bool(torch.equal(gen.sequences, rgen.sequences))
    out["generate"] = gen.sequences[0, -5:].tolist()
    out["generate_scores"] = max(rel(a.float(), b.float()) for a, b in zip(gen.scores, rgen.scores))
    if not out["generate_equal"]:
        out["generate_ref"] = rgen.sequences[0, -5:].tolist()
    # last: merge_and_unload swaps each LoRA module for its base layer
    try:
        merged, rmerged = model.merge_and_unload(), ref.merge_and_unload()
        with torch.no_grad():
            out["merge_and_unload_logits"] = rel(
                merged(input_ids=ids).logits.float(), rmerged(input_ids=ids).logits.float()
            )
        out["merge_and_unload_vs_unmerged"] = rel(merged(input_ids=ids).logits.float().detach(), before)
    except Exception as e:
        out["merge_and_unload"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def check_adapter_io(rank, ws, model, ref, sc):
    """peft's save_pretrained / get_peft_model_state_dict / from_pretrained /
    set_peft_model_state_dict on a compiled model."""
    from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    out = {}
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    path = path[0]
    # 1. save_pretrained with no state dict: the documented ValueError
    try:
        model.save_pretrained(path + "/bad")
        out["save_without_sd"] = "no error"
    except Exception as e:
        out["save_without_sd"] = f"{type(e).__name__}: {str(e)[:100]}"
    # 2. get_peft_model_state_dict(model) as is: what does it hold?
    try:
        sd = get_peft_model_state_dict(model)
        kinds = {type(v).__name__ for v in sd.values()}
        out["get_peft_sd_plain"] = f"{len(sd)} keys, {sorted(kinds)}"
        if any(isinstance(v, DTensor) for v in sd.values()):
            out["get_peft_sd_plain"] += f", placements {sorted({str(v.placements) for v in sd.values()})}"
    except Exception as e:
        out["get_peft_sd_plain"] = f"{type(e).__name__}: {str(e)[:200]}"
    # 3. the documented way
    fsd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    adapter = get_peft_model_state_dict(model, state_dict=fsd) if rank == 0 else None
    if rank == 0:
        model.save_pretrained(path, state_dict=fsd)
    dist.barrier()
    out["saved_files"] = sorted(os.listdir(path))
    # reference adapter
    ref_adapter = get_peft_model_state_dict(ref)
    if rank == 0:
        worst = 0.0
        assert set(adapter) == set(ref_adapter), (sorted(adapter), sorted(ref_adapter))
        for k in ref_adapter:
            worst = max(worst, rel(adapter[k], ref_adapter[k]))
        out["exported_adapter_vs_ref"] = worst
        out["adapter_keys"] = len(adapter)
    # 4. load the saved adapter into a fresh unsharded base
    torch.manual_seed(0)
    base = llama(tie=getattr(sc, "_tie", True))
    loaded = PeftModel.from_pretrained(base, path)
    lsd = get_peft_model_state_dict(loaded)
    out["reloaded_unsharded_vs_ref"] = max(rel(lsd[k], ref_adapter[k]) for k in ref_adapter)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        rlog = ref(input_ids=ids).logits.float()
        out["reloaded_unsharded_logits"] = rel(loaded(input_ids=ids).logits.float(), rlog)
    # 5. load it into a freshly compiled peft model (before and after compile)
    torch.manual_seed(0)
    fresh = State.make()
    fxshard.compile(fresh, **{k: v for k, v in sc.compile_kwargs.items()})
    from safetensors.torch import load_file

    asd = load_file(os.path.join(path, "adapter_model.safetensors"))
    res = set_peft_model_state_dict(fresh, asd)
    out["set_peft_sd_unexpected"] = len(res.unexpected_keys)
    with torch.no_grad():
        out["reloaded_compiled_logits"] = rel(fresh(input_ids=ids).logits.float(), rlog)
    # 6. load_adapter of a second adapter after compile: new parameters after compile
    try:
        fresh.load_adapter(path, adapter_name="second")
        out["load_adapter_after_compile"] = "no error"
    except Exception as e:
        out["load_adapter_after_compile"] = f"{type(e).__name__}: {str(e)[:160]}"
    dist.barrier()
    return out


# ---------------------------------------------------------------- cases


def timm_sc(make, backend, ck=None, **kw):
    kw.setdefault("steps", 2)
    kw.setdefault("param_grad_floor", 0.0)
    return Scenario(
        make_model=make, make_batch=images, loss=sq, compile_kwargs=dict(backend=backend, **(ck or {})), **kw
    )


def peft_sc(backend, tie=True, bf16=False, save=None, targets=("q_proj", "v_proj", "down_proj"), ck=None, **kw):
    make = lora(tie=tie, targets=targets, save=save)
    compile_kwargs = dict(backend=backend, **(ck or {}))
    if bf16:
        compile_kwargs["mp_policy"] = MP
        kw = {**BF16, **kw}
    kw.setdefault("steps", 2)
    sc = Scenario(
        make_model=make,
        make_batch=tokens,
        loss=hf_loss,
        compile_kwargs=compile_kwargs,
        freeze=frozen_names(make),
        param_grad_floor=0.0,
        **kw,
    )
    object.__setattr__(sc, "_tie", tie)
    return sc


CASES: dict[str, dict] = {}


def case(name, sc, post=(), buffers=False):
    CASES[name] = dict(sc=sc, post=post, buffers=buffers)


for be, tag in (("aot_eager", "aot"), ("inductor", "ind")):
    case(f"vit_{tag}", timm_sc(vit, be))
    case(f"resnet18_{tag}", timm_sc(resnet, be), buffers=True)
    case(f"convnext_atto_{tag}", timm_sc(convnext, be))
    case(f"effnet_b0_{tag}", timm_sc(effnet, be), buffers=True)
    case(f"mobilenetv3_{tag}", timm_sc(mobilenet, be), buffers=True)
    for tie in (True, False):
        for bf in (False, True):
            t = f"{'tied' if tie else 'untied'}_{'bf16' if bf else 'fp32'}"
            case(f"lora_{t}_{tag}", peft_sc(be, tie=tie, bf16=bf), post=(check_merge_generate,))
    # better-conditioned batch norm: 8 images of 64 px (the last feature map 2 x 2)
    for nm, mk in (("resnet18", resnet), ("effnet_b0", effnet), ("mobilenetv3", mobilenet)):
        case(f"{nm}_64px_{tag}", dataclasses.replace(timm_sc(mk, be), make_batch=images64), buffers=True)
# wider peft
case("lora_qv_only_aot", peft_sc("aot_eager", targets=("q_proj", "v_proj")))
case("lora_mts_untied_aot", peft_sc("aot_eager", tie=False, save=("lm_head",)), post=(check_merge_generate,))
case("lora_mts_untied_ind", peft_sc("inductor", tie=False, save=("lm_head",)))
case("lora_mts_tied_aot", peft_sc("aot_eager", tie=True, save=("lm_head",)))
case("lora_zero1_aot", peft_sc("aot_eager", ck=dict(zero_stage=1), micro_batches=2))
case("lora_zero2_aot", peft_sc("aot_eager", ck=dict(zero_stage=2), micro_batches=2))
case("lora_zero1_ind", peft_sc("inductor", ck=dict(zero_stage=1), micro_batches=2))
case("lora_zero2_ind", peft_sc("inductor", ck=dict(zero_stage=2), micro_batches=2))
case("lora_nosync_aot", peft_sc("aot_eager", micro_batches=3, no_sync=True))
case("lora_nosync_ind", peft_sc("inductor", micro_batches=3, no_sync=True))
case("lora_nosync_bf16_untied_aot", peft_sc("aot_eager", tie=False, bf16=True, micro_batches=3, no_sync=True))
case("lora_zero1_nosync_aot", peft_sc("aot_eager", ck=dict(zero_stage=1), micro_batches=3, no_sync=True))
case("lora_zero2_nosync_aot", peft_sc("aot_eager", ck=dict(zero_stage=2), micro_batches=3, no_sync=True))
case(
    "lora_mts_nosync_zero2_aot",
    peft_sc("aot_eager", tie=False, save=("lm_head",), ck=dict(zero_stage=2), micro_batches=2, no_sync=True),
)
case("lora_adapter_io_aot", peft_sc("aot_eager"), post=(check_adapter_io,))
case("lora_mts_adapter_io_aot", peft_sc("aot_eager", tie=False, save=("lm_head",)), post=(check_adapter_io,))
case("resnet18_nosync_aot", timm_sc(resnet, "aot_eager", micro_batches=2, no_sync=True), buffers=True)
case("resnet18_zero2_aot", timm_sc(resnet, "aot_eager", ck=dict(zero_stage=2)), buffers=True)

# diagnostics
case("resnet18_accum_aot", timm_sc(resnet, "aot_eager", micro_batches=2), buffers=True)
case(
    "resnet18_nosync_floor_aot",
    timm_sc(resnet, "aot_eager", micro_batches=2, no_sync=True, param_grad_floor=1e-4),
    buffers=True,
)
case("lora_tied_bf16_ind_1step", peft_sc("inductor", bf16=True, steps=1))
case("lora_tied_bf16_aot_1step", peft_sc("aot_eager", bf16=True, steps=1))

GROUPS = {
    "timm_aot": "vit_aot,resnet18_aot,convnext_atto_aot",
    "timm_ind": "vit_ind,resnet18_ind,convnext_atto_ind",
    "lora_aot": "lora_tied_fp32_aot,lora_untied_fp32_aot,lora_tied_bf16_aot,lora_untied_bf16_aot",
    "lora_ind": "lora_tied_fp32_ind,lora_untied_fp32_ind,lora_tied_bf16_ind,lora_untied_bf16_ind",
}


def run(rank, ws, names):
    out = {}
    for n in names:
        base, _, opt = n.partition("+")  # NAME+refc: the reference compiled by torch.compile with the same backend
        c = CASES[base]
        sc = c["sc"]
        State.ref_compile = opt == "refc"
        State.rec, State.ref, State.rank, State.ws = Rec(), None, rank, ws
        State.track_buffers, State.ref_calls, State.shadow = c["buffers"], 0, None
        State.make = sc.make_model
        res = dict(case=n)
        t0 = time.perf_counter()
        mism: list[str] = []
        try:
            model = train_and_compare(rank, ws, sc, mismatches=mism)["model"]
            plan = model.fxshard_plan
            pl = [str(p.placement) for p in plan.params]
            res.update(
                sequenced=plan.sequenced,
                reason=plan.graph_break_reason,
                graphs=len(plan.graphs),
                placements={k: pl.count(k) for k in sorted(set(pl))},
            )
            res["train_s"] = round(time.perf_counter() - t0, 1)
            for post in c["post"]:
                try:
                    res[post.__name__] = post(rank, ws, model, State.ref, sc)
                except Exception:
                    res[post.__name__] = {"error": traceback.format_exc()[-2500:]}
            if c["buffers"]:
                try:
                    res["check_buffers"] = check_buffers(rank, ws, model, State.ref, sc)
                except Exception:
                    res["check_buffers"] = {"error": traceback.format_exc()[-2500:]}
        except Exception:
            res["error"] = traceback.format_exc()[-4000:]
        res.update(State.rec.summary())
        res["n_compared"] = State.rec.n
        res["mismatches"] = [m[:600] for m in mism[:6]]
        res["n_mismatches"] = len(mism)
        res["s"] = round(time.perf_counter() - t0, 1)
        out[n] = res
        print(f"[rank {rank}] {n} done in {res['s']} s", file=sys.stderr, flush=True)
        torch._dynamo.reset()
    return out


def control(name, ws):
    """No fxshard: the unsharded model in eager against torch.compile(backend=...)
    of it, on the harness's batches, loss, AdamW and comparisons. What the
    compiler alone changes."""
    sc = CASES[name]["sc"]
    backend = sc.compile_kwargs.get("backend", "inductor")
    rec = Rec()
    torch.manual_seed(0)
    a = parity._reference(sc)
    torch.manual_seed(0)
    b = parity._reference(sc)
    b.load_state_dict(a.state_dict())
    cb = torch.compile(b, backend=backend)
    pa = [p for p in a.parameters() if p.requires_grad]
    pb = [p for p in b.parameters() if p.requires_grad]
    names = [n for n, p in a.named_parameters() if p.requires_grad]
    oa = torch.optim.AdamW(pa, lr=1e-2, eps=1e-6)
    ob = torch.optim.AdamW(pb, lr=1e-2, eps=1e-6)
    masks = [torch.zeros_like(p, dtype=torch.bool) for p in pa]
    per_step = sc.forwards_per_step * sc.micro_batches
    for step in range(sc.steps):
        gens = [torch.Generator().manual_seed(1000 * step + 10 * r + i) for r in range(ws) for i in range(per_step)]
        batches = [sc.make_batch(g) for g in gens]
        per_rank = [batches[r * per_step : (r + 1) * per_step] for r in range(ws)]
        la = sum(_orig_step_loss(a, pr, sc) for pr in per_rank) / ws
        lb = sum(_orig_step_loss(cb, pr, sc) for pr in per_rank) / ws
        la.backward()
        lb.backward()
        rec.add(lb.float(), la.float(), f"step {step} loss")
        for n, x, y, m in zip(names, pa, pb, masks):
            rec.add(y.grad.float(), x.grad.float(), f"step {step} grad of {n}")
            m |= x.grad.abs() > 0
        for opt in (oa, ob):
            opt.step()
            opt.zero_grad()
    for n, x, y, m in zip(names, pa, pb, masks):
        rec.add(y.detach().float()[m], x.detach().float()[m], f"param {n} after")
    return rec.summary()


def main():
    if sys.argv[1] == "control":
        ws = int(sys.argv[2])
        torch.set_num_threads(1)
        for n in sys.argv[3].split(","):
            t0 = time.perf_counter()
            v = control(n, ws)
            torch._dynamo.reset()
            print(
                f"control ws{ws} {n:30s} loss={v['loss']:.2e} grad={v['grad']:.2e} gradtensor={v['gradtensor']:.2e} "
                f"param={v['param']:.2e} ({v['param_at']}) {time.perf_counter() - t0:.0f}s",
                flush=True,
            )
        return
    if sys.argv[1] == "list":
        print("\n".join(CASES))
        return
    ws = int(sys.argv[1])
    names = []
    for n in sys.argv[2].split(","):
        names += GROUPS[n].split(",") if n in GROUPS else [n]
    t0 = time.perf_counter()
    results = run_ranks(ws, run, names, timeout=float(os.environ.get("TP_TIMEOUT", 1500)))
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    tag = os.environ.get("TP_TAG") or f"ws{ws}-{sys.argv[2].replace(',', '+')[:80]}"
    with open(os.path.join(os.path.dirname(__file__), "results", f"{tag}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    for r, x in enumerate(results):
        if "__error__" in x:
            print(f"rank {r} ERROR", x["__error__"][-3000:])
            continue
        for k, v in x.items():
            ok = (
                "error" not in v
                and not v["n_mismatches"]
                and all(
                    "error" not in v.get(p, {}) for p in ("check_merge_generate", "check_adapter_io", "check_buffers")
                )
            )
            print(
                f"ws{ws} r{r} {k:32s} {'PASS' if ok else 'FAIL'} loss={v['loss']:.2e} grad={v['grad']:.2e} "
                f"gradtensor={v['gradtensor']:.2e} param={v['param']:.2e} gmax={v['gmax']:.1e} n={v['n_compared']} seq={v.get('sequenced')} "
                f"pl={v.get('placements')} {v['s']}s"
            )
            for extra in ("check_merge_generate", "check_adapter_io", "check_buffers"):
                if extra in v:
                    print(f"      {extra}: {v[extra]}")
            if "error" in v:
                print("      ERROR:", v["error"][-1500:])
            for m in v["mismatches"]:
                print("      MISMATCH:", m[:400])
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
