#!/usr/bin/env python3
"""Checks kiln's ResNet-18 / DenseNet-121 against torchvision.

Reads a folder written by `cargo run --release --example vision_check` (weights.safetensors,
input.safetensors, kiln_output.safetensors, meta.json), loads the weights into torchvision's model
with load_state_dict(strict=True), runs it in eval mode in float32 and in float64, and compares
kiln's logits with both.

    python3 tools/vision_reference.py FOLDER [FOLDER ...] [--tol 1e-4] [--device cpu|cuda]

Error measure: max |kiln - torch| / max |torch| over the whole output (an elementwise relative error
is meaningless for logits near zero). The float64 run is the better reference (it measures kiln's
own float32 rounding); the float32 run shows how far two float32 implementations land apart.
Exit status: 0 when both comparisons are within --tol, 1 on a mismatch or a failed load, 2 on
usage or file errors.
"""

import argparse
import copy
import json
import os
import struct
import sys

import torch
import torchvision


def load_safetensors(path):
    """{name: tensor} from a .safetensors file: safetensors.torch.load_file when the package is
    installed, else a parser of the format (8-byte little-endian header length, JSON header, data)."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        return parse_safetensors(path)
    return load_file(path)


SAFETENSORS_DTYPES = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}


def parse_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short for a safetensors file ({len(raw)} bytes)")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if 8 + header_len > len(raw):
        raise ValueError(f"{path}: header length {header_len} runs past the end of the file")
    header = json.loads(raw[8 : 8 + header_len].decode("utf-8"))
    data = raw[8 + header_len :]
    if sys.byteorder != "little":
        raise ValueError("the fallback parser assumes a little-endian machine")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype, itemsize = SAFETENSORS_DTYPES[info["dtype"]]
        shape = list(info["shape"])
        begin, end = info["data_offsets"]
        numel = 1
        for d in shape:
            numel *= d
        if not (0 <= begin <= end <= len(data)) or end - begin != numel * itemsize:
            raise ValueError(
                f"{path}: tensor {name!r} ({info['dtype']} {shape}) has data_offsets "
                f"[{begin}, {end}] for {numel * itemsize} bytes in a {len(data)}-byte buffer"
            )
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        # bytearray: a writable copy, so torch.frombuffer does not warn and the tensor owns its data
        buf = bytearray(data[begin:end])
        out[name] = torch.frombuffer(buf, dtype=dtype, count=numel).reshape(shape).clone()
    return out


def build_model(name, num_classes):
    ctor = getattr(torchvision.models, name, None)
    if ctor is None:
        raise ValueError(f"torchvision.models has no {name!r}")
    try:
        return ctor(weights=None, num_classes=num_classes)
    except TypeError:  # torchvision < 0.13
        return ctor(pretrained=False, num_classes=num_classes)


def only_tensor(path, key):
    tensors = load_safetensors(path)
    if key not in tensors:
        raise ValueError(f"{path}: expected a tensor named {key!r}, found {sorted(tensors)}")
    return tensors[key]


def errors(kiln_out, reference):
    """(max abs error, max abs error / max |reference|), computed in float64."""
    k, r = kiln_out.double(), reference.double()
    max_abs = (k - r).abs().max().item()
    scale = r.abs().max().item()
    return max_abs, (max_abs / scale if scale > 0 else float("inf") if max_abs > 0 else 0.0)


def check_folder(folder, tol, device):
    meta_path = os.path.join(folder, "meta.json")
    meta = {}
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    name = meta.get("model") or os.path.basename(os.path.normpath(folder))
    weights = load_safetensors(os.path.join(folder, "weights.safetensors"))
    x = only_tensor(os.path.join(folder, "input.safetensors"), "input")
    kiln_out = only_tensor(os.path.join(folder, "kiln_output.safetensors"), "output")
    num_classes = int(meta.get("num_classes", kiln_out.shape[-1]))

    model = build_model(name, num_classes)
    # strict: every key of torchvision's state dict is in the file and nothing else, same shapes
    model.load_state_dict(weights, strict=True)
    model.eval()
    model64 = copy.deepcopy(model).double()

    with torch.no_grad():
        out32 = model.to(device)(x.to(device)).cpu()
        out64 = model64.to(device)(x.double().to(device)).cpu()

    if tuple(out32.shape) != tuple(kiln_out.shape):
        print(f"{folder}: {name}: output shape torch {tuple(out32.shape)} vs kiln {tuple(kiln_out.shape)}")
        return False
    abs32, rel32 = errors(kiln_out, out32)
    abs64, rel64 = errors(kiln_out, out64)
    abs_tt, rel_tt = errors(out32, out64)
    same_top1 = bool((kiln_out.argmax(-1) == out64.argmax(-1)).all())
    ok = rel32 <= tol and rel64 <= tol
    print(f"{folder}: torchvision {name}, input {tuple(x.shape)}, output {tuple(out32.shape)}, "
          f"max |logit| {out64.abs().max().item():.4g}, {len(weights)} tensors loaded (strict)")
    print(f"  kiln vs torch float32: max abs {abs32:.3e}  rel {rel32:.3e}")
    print(f"  kiln vs torch float64: max abs {abs64:.3e}  rel {rel64:.3e}")
    print(f"  (torch float32 vs float64: max abs {abs_tt:.3e}  rel {rel_tt:.3e})")
    print(f"  top-1 agrees with float64: {same_top1}")
    print(f"  {'OK' if ok else 'MISMATCH'} (tolerance {tol:g} relative to max |logit|)")
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", help="folders written by the vision_check example")
    p.add_argument("--tol", type=float, default=1e-4, help="max |kiln - torch| / max |torch|")
    p.add_argument("--device", default="cpu", help="torch device for the reference (cpu, cuda)")
    args = p.parse_args()

    # float32 references must be float32: no TF32 convolutions or matmuls on Ampere and later
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_grad_enabled(False)

    all_ok = True
    for folder in args.folders:
        try:
            ok = check_folder(folder, args.tol, args.device)
        except (OSError, ValueError) as e:
            print(f"{folder}: error: {e}", file=sys.stderr)
            return 2
        except RuntimeError as e:  # load_state_dict(strict=True) mismatches, shape errors
            print(f"{folder}: torch error: {e}", file=sys.stderr)
            ok = False
        all_ok = all_ok and ok
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
