# What a DenseNet-121 warm start's module loads and function lookups cost, unit by unit, against
# each cubin's size and its functions' code sizes (ELF .text sections), in a quiet process (ctypes
# on libcuda). Fills a cache folder first with a cold compile of BIN (default carry/gpu/kiln-bench)
# under ROOT (default /tmp/kc-mod2). On the GPU machine, generated convolutions:
#   KILN_CONV=generated python3 tools/module_loads.py   (CUDA_MODULE_LOADING=EAGER to compare)
import ctypes, glob, os, struct, subprocess, sys, time
root = os.environ.get("ROOT", "/tmp/kc-mod2")
env = dict(os.environ, KILN_CACHE_DIR=root, KILN_CONV="generated")
subprocess.run([os.environ.get("BIN", "carry/gpu/kiln-bench"), "compile-child:train:densenet121", "--device", "cuda", "--quick"],
               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def texts(img):
    # ELF64: section headers -> {name: size} for .text.* sections
    shoff, = struct.unpack_from("<Q", img, 0x28); shentsize, shnum, shstrndx = struct.unpack_from("<HHH", img, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", img, shoff + i * shentsize) for i in range(shnum)]
    stroff = secs[shstrndx][4]
    name = lambda o: img[stroff + o: img.index(b"\0", stroff + o)].decode()
    return {name(s[0]): s[5] for s in secs if name(s[0]).startswith(".text.")}
units = []
for m in glob.glob(f"{root}/graphs/cuda-units/*.txt"):
    for line in open(m):
        line = line.rstrip("\n")
        if "\t" not in line: continue
        ident, names = line.split("\t"); units.append((ident.split()[1], names.split()))
unit_keys = {k for k, _ in units}
others = [f for f in glob.glob(f"{root}/cuda/*.cubin") if os.path.basename(f)[:-6] not in unit_keys]
cu = ctypes.CDLL("libcuda.so.1"); assert cu.cuInit(0) == 0
dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0; cu.cuCtxSetCurrent(ctx)
def load(img):
    m = ctypes.c_void_p(); t = time.perf_counter(); r = cu.cuModuleLoadData(ctypes.byref(m), ctypes.c_char_p(img))
    assert r == 0, r; return m, time.perf_counter() - t
def lookup(m, n):
    f = ctypes.c_void_p(); t = time.perf_counter(); r = cu.cuModuleGetFunction(ctypes.byref(f), m, n.encode()); assert r == 0, r
    return time.perf_counter() - t
# warm the driver (one module, not counted)
load(open(others[0], "rb").read())
tot = [0, 0, 0.0, 0.0, 0]
rows = []
for key, names in units:
    img = open(f"{root}/cuda/{key}.cubin", "rb").read(); tx = texts(img)
    m, tl = load(img); tf = [lookup(m, n) for n in names]
    code = sum(tx.values())
    rows.append((len(img), code, len(names), tl * 1e3, sum(tf) * 1e3))
    tot[0] += len(img); tot[1] += code; tot[2] += tl * 1e3; tot[3] += sum(tf) * 1e3; tot[4] += len(names)
for r in rows: print("unit %7d B, code %7d B, %2d fns: load %.3f ms, lookups %.3f ms" % r)
print("units: %d cubins %.2f MB, code %.2f MB, %d fns; loads %.2f ms, lookups %.2f ms" % (len(units), tot[0]/1e6, tot[1]/1e6, tot[4], tot[2], tot[3]))
# the other cubins (convolutions, eager kernels): load + every function
ot = [0, 0.0, 0.0]
for f in sorted(others, key=os.path.getsize)[-12:]:
    img = open(f, "rb").read(); tx = texts(img); m, tl = load(img)
    tf = [lookup(m, n[6:]) for n in tx]
    print("other %7d B, code %7d B, %2d fns: load %.3f ms, lookups %.3f ms  %s" % (len(img), sum(tx.values()), len(tx), tl*1e3, sum(tf)*1e3, " ".join(n[6:][:24] for n in tx)[:100]))
# per-function code size vs lookup time, the largest units' functions
big = []
for key, names in units:
    img = open(f"{root}/cuda/{key}.cubin", "rb").read(); tx = texts(img)
    for n in names: big.append((tx.get(".text." + n, 0), n))
big.sort()
print("function code sizes: min %d, median %d, max %d, total %d" % (big[0][0], big[len(big)//2][0], big[-1][0], sum(b for b, _ in big)))
print("largest:", big[-8:])
