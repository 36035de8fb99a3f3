"""The decode speed no engine can beat on this machine: every linear layer of the model once per
token (weights streamed from memory), with nothing else.  At batch 1 a decode step is bound by
reading the weights, so this ceiling bounds any speed-up of the step itself.

    python benchmarks/linear_ceiling.py --model smollm2-135m --threads 2
"""

import argparse
import time

import torch

from kvsieve.models import load_model


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, device="cpu", dtype="float32")
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    print(f"{len(weights)} linear layers, {sum(w.numel() for w in weights) / 1e6:.1f}M parameters")
    for batch in map(int, args.batches.split(",")):
        inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}
        with torch.inference_mode():
            for _ in range(3):  # warm-up
                for w in weights:
                    torch.nn.functional.linear(inputs[w.shape[1]], w)
            start = time.perf_counter()
            for _ in range(10):
                for w in weights:
                    torch.nn.functional.linear(inputs[w.shape[1]], w)
            seconds = (time.perf_counter() - start) / 10
        print(f"batch {batch}: all linear layers once {seconds * 1e3:.1f} ms -> at most {batch / seconds:.1f} tokens/s")


if __name__ == "__main__":
    main()
