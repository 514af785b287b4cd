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
"""
import re
import sys

# a definition at the start of a line, its body up to the first "}" at the start of a line: the
# CUDA target's kernels, the C target's member functions (its `k_` symbols only call them)
CUDA_KERNEL = re.compile(
    r'^(?:extern "C" )?__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\((.*?)\)\s*\{\n'
    r"(.*?)\n\}$",
    re.M | re.S,
)
C_MEMBER = re.compile(
    r"^(?:__attribute__\(\([^)]*\)\) )?static void (m_\w+)\((.*?)\)\s*\{\n(.*?)\n\}$",
    re.M | re.S,
)
NAME = re.compile(r"\b[mk]l?_[0-9a-f]{8,}\b")
INTEGER = re.compile(r"(?<![\w.])-?\d+(?![\w.])")


def main(paths):
    bodies = {}
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for name, sig, body in CUDA_KERNEL.findall(text) or C_MEMBER.findall(text):
            bodies[name] = sig + "{" + body + "}"
    shapes = {INTEGER.sub("N", NAME.sub("F", b)) for b in bodies.values()}
    print(f"{len(bodies)} kernels, {len(shapes)} distinct once integer constants are arguments")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
