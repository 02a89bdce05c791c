"""A few NCCL parity checks on 2 GPUs: the final code on the device's torch."""

from tests.distributed import run_ranks
from tests.parity import run_all

if __name__ == "__main__":
    names = [
        "hf_eval_changing_lengths",
        "units_small_prefetch2@inductor",
        "mixed_precision_bf16_inductor",
        "llama_tied_inductor",
    ]
    results = run_ranks(2, run_all, names, timeout=500, backend="nccl")
    for r, res in enumerate(results):
        if "__error__" in res:
            print("rank", r, res["__error__"][-2000:])
            continue
        for k, v in res.items():
            print(r, k, "OK" if v is None else v[-1500:])
