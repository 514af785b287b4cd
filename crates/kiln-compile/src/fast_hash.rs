//! A hasher for the compiler's own tables, keyed by small integers: tensor ids (AOT autograd's
//! recorder), node ids and index expressions (kiln-inductor's planner), hashed a word at a time
//! with one multiply (the multiply-rotate of rustc's FxHash). The standard library's SipHash
//! resists adversarial keys, which these are not; it was a tenth of planning DenseNet-121's
//! training graphs (most of it hashing the expression builder's `Ix` keys) and about 8% of
//! building its 14,556-node joint graph (an id looked up per operand, one inserted per value).

use std::hash::{BuildHasherDefault, Hasher};

/// `HashMap<K, V, Fast>`: a map with the fast hasher.
pub type Fast = BuildHasherDefault<FastHasher>;

const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

#[derive(Default)]
pub struct FastHasher(u64);

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

/// Words come through `write_u64` and `write_usize` (node ids, `Ix`'s coefficients and
/// constants: `write_i64` defaults to `write_u64`); other bytes a word or a byte at a time.
impl Hasher for FastHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        for &b in chunks.remainder() {
            self.add(b as u64);
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::Fast;

    /// Consecutive ids (as a counter hands them out) all find their values.
    #[test]
    fn consecutive_ids_find_their_values() {
        let mut m: HashMap<u64, usize, Fast> = HashMap::default();
        for id in 1000..6000u64 {
            m.insert(id, id as usize * 3);
        }
        assert_eq!(m.len(), 5000);
        assert!((1000..6000u64).all(|id| m.get(&id) == Some(&(id as usize * 3))));
        assert_eq!(m.get(&999), None);
    }
}
