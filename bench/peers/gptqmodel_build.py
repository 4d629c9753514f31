"""Peer side of bench/gptq_peer.py: quantize a model with GPTQModel on the given token windows.

Runs in GPTQModel's own venv (it needs torch >= 2.14.1; this project pins 2.13), so it imports nothing of
ours. Prints one JSON line: the quantization seconds (load and save excluded) and the peak RSS.

    <venv>/bin/python bench/peers/gptqmodel_build.py MODEL_DIR IDS.pt OUT --group-size 64 --damp 0.01
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("ids", help="a torch file holding an int64 (S, T) tensor of calibration windows")
    ap.add_argument("out")
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--damp", type=float, required=True)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from gptqmodel import GPTQModel, QuantizeConfig

    ids = torch.load(args.ids)  # (S, T)
    calib = [{"input_ids": row.tolist(), "attention_mask": [1] * row.numel()} for row in ids]
    # GPTQModel's defaults otherwise: desc_act off with act_group_aware on (its group-aware reordering, the
    # counterpart of our act-order with static groups: g_idx stays k // group).
    qcfg = QuantizeConfig(bits=4, group_size=args.group_size, sym=True, damp_percent=args.damp)
    t0 = time.perf_counter()
    model = GPTQModel.load(args.model, qcfg, device="cpu")
    t1 = time.perf_counter()
    model.quantize(calib, batch_size=1, calibration_sort=None)
    t2 = time.perf_counter()
    model.save(args.out)
    t3 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "quantize_s": t2 - t1, "save_s": t3 - t2, "total_s": t3 - t0,
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                      "act_group_aware": qcfg.act_group_aware, "desc_act": qcfg.desc_act}))


if __name__ == "__main__":
    main()
