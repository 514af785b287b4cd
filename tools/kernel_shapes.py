#!/usr/bin/env python3
"""How many of a compile's kernels differ only in their integer constants (sizes, strides,
offsets): the count of kernels a compiler that passed those as arguments would build and load.

    python3 tools/kernel_shapes.py FILE...

FILE: generated source, as the C target keeps it in the cache folder (`KILN_CACHE_DIR/*.c`), or
a log of `KILN_LOGS=output_code` (the CUDA target logs each unit's source there, on a warm start
too), e.g. `KILN_LOGS=output_code kiln-bench compile-child:train:densenet121 --device cuda
--mode default --quick 2>code.log`. Counted: the CUDA target's kernels (`__global__ void`), or
where a file has none, the C target's member functions (`static void m_...`: its `k_` symbols
only call them), each body up to the first closing brace at the start of a line; a function
defined twice (in two units) counts once. A lower bound: constants that shape the code (vector
widths, unroll counts, a launch's block size in its body) are made arguments too.

The CUDA target's launches of several members (horizontal, sequential) are a `__global__`
dispatcher calling `__device__` functions: a dispatcher is counted with its members' texts (its
own names its members, which are counted as device functions too), so two dispatchers whose
members differ only in constants count once, as `codegen/cuda_literals.rs` shares them.
"""
import re
import sys

# a definition at the start of a line, its body up to the first "}" at the start of a line: the
# CUDA target's kernels and device functions, the C target's member functions (its `k_` symbols
# only call them)
CUDA_FUNCTION = re.compile(
    r'^(?:extern "C" )?(__global__|__device__ __noinline__) void (?:__launch_bounds__\(\d+\) )?'
    r"(\w+)\((.*?)\)\s*\{\n(.*?)\n\}$",
    re.M | re.S,
)
C_MEMBER = re.compile(
    r"^(?:__attribute__\(\([^)]*\)\) )?static void (m_\w+)\((.*?)\)\s*\{\n(.*?)\n\}$",
    re.M | re.S,
)
# generated names: kernels (k_, kl_), their members (m_; d_, s_ as device functions, and a
# shared dispatcher's own copies, kl_<hash>_f<i>)
NAME = re.compile(r"\b[mkds]l?_[0-9a-f]{8,}(?:_f\d+)?\b")
INTEGER = re.compile(r"(?<![\w.])-?\d+(?![\w.])")


def shape(text):
    return INTEGER.sub("N", NAME.sub("F", text))


def main(paths):
    kernels, device_fns = {}, {}
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        cuda = CUDA_FUNCTION.findall(text)
        for qual, name, sig, body in cuda:
            table = kernels if qual == "__global__" else device_fns
            table[name] = sig + "{" + body + "}"
        if not cuda:
            for name, sig, body in C_MEMBER.findall(text):
                kernels[name] = sig + "{" + body + "}"
    fn_shapes = {name: shape(b) for name, b in device_fns.items()}

    def launch_shape(body):
        # a dispatcher with its members' texts, in the order it calls them
        members = [fn_shapes.get(m, m) for m in NAME.findall(body) if m in fn_shapes]
        return shape(body) + "".join(members)

    shapes = {launch_shape(b) for b in kernels.values()}
    print(f"{len(kernels)} kernels, {len(shapes)} distinct once integer constants are arguments")
    if device_fns:
        print(
            f"{len(device_fns)} device functions, {len(set(fn_shapes.values()))} distinct once "
            "integer constants are arguments"
        )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
