//! Static shared memory: what a generated kernel's `__shared__` arrays take. CUDA gives a kernel
//! 48 KiB of it (more is dynamic shared memory, with an opt-in per function); a launch that runs
//! several kernels side by side or in sequence declares all their arrays, so the planners that
//! compose launches (`horizontal.rs`, `cuda_sequential.rs`) add them up before they join.

use super::cuda::CudaKernel;

/// Static shared memory a kernel may declare: CUDA's limit for `__shared__` arrays (more needs
/// dynamic shared memory and an opt-in). A launch of several kernels side by side holds all
/// their arrays at once, so `horizontal.rs` joins kernels only while theirs add up to this.
pub const STATIC_SHARED_MAX: u32 = 48 << 10;

/// Bytes of the `__shared__` arrays `k` declares, in its body and its device functions (a
/// horizontal kernel's members): `T name[a][b]...` with literal lengths (`cuda_literals.rs`
/// keeps them literal). An array whose length is not a literal counts as the whole limit.
pub fn static_shared_bytes(k: &CudaKernel) -> u32 {
    std::iter::once(k.text.as_str())
        .chain(k.device_fns.iter().map(|(_, def)| def.as_str()))
        .map(declared_shared)
        .fold(0u32, u32::saturating_add)
}

fn declared_shared(text: &str) -> u32 {
    let mut total = 0u32;
    for (at, _) in text.match_indices("__shared__") {
        if text[..at].trim_end().ends_with("extern") {
            continue;
        }
        let decl = text[at + "__shared__".len()..]
            .split(';')
            .next()
            .unwrap_or("");
        let Some(open) = decl.find('[') else {
            continue;
        };
        // the type: every word before the name but an alignment
        let words: Vec<&str> = decl[..open]
            .split_whitespace()
            .filter(|w| !w.starts_with("__align__"))
            .collect();
        let ty = words[..words.len().saturating_sub(1)].join(" ");
        let size: u32 = match ty.as_str() {
            "float" | "int" | "unsigned" | "unsigned int" | "int32_t" => 4,
            "u16" | "short" | "unsigned short" => 2,
            "u8" | "char" | "unsigned char" | "bool" => 1,
            _ => 8,
        };
        let count = decl[open..]
            .split('[')
            .skip(1)
            .map(|d| d.split(']').next().unwrap_or("").trim().parse::<u32>().ok())
            .try_fold(1u32, |n, d| d.and_then(|d| n.checked_mul(d)));
        total = total.saturating_add(match count {
            Some(n) => n.saturating_mul(size),
            None => STATIC_SHARED_MAX,
        });
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each array's length times its element's size; `extern` (dynamic) arrays and text
    /// without arrays count nothing; a length that is not a literal counts as the whole limit.
    #[test]
    fn declared_arrays_are_counted_by_type_and_lengths() {
        let text = "  __shared__ float col_a[32][32];\n  __shared__ double p[8];\n  \
                    extern __shared__ __align__(16) unsigned char ksm[];\n  \
                    __shared__ __align__(16) unsigned short h[10];\n  float x = 1;\n";
        assert_eq!(declared_shared(text), 32 * 32 * 4 + 8 * 8 + 10 * 2);
        assert_eq!(declared_shared("  float y[4];\n"), 0);
        assert_eq!(
            declared_shared("  __shared__ float w[n];\n"),
            STATIC_SHARED_MAX
        );
    }
}
