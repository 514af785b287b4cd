//! Small real datasets for examples and tests.

use std::io::Read;
use std::path::{Path, PathBuf};

use kiln_core::{Error, Result, Tensor};

/// The UCI optical handwritten digits (8x8 images, 10 classes), as shipped with scikit-learn.
pub struct Digits {
    /// [N, 64] pixel values scaled to [0, 1].
    pub images: Tensor,
    /// [N] labels 0..9 (int64).
    pub labels: Tensor,
}

/// Where the digits file lives: `$KILN_DIGITS`, else `../shared/data/digits.csv.gz` from the
/// workspace root or any parent of the current directory.
pub fn digits_path() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("KILN_DIGITS") {
        return Ok(PathBuf::from(p));
    }
    let mut roots = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR"))];
    if let Ok(cwd) = std::env::current_dir() {
        roots.push(cwd);
    }
    for root in roots {
        for dir in root.ancestors() {
            let p = dir.join("shared/data/digits.csv.gz");
            if p.exists() {
                return Ok(p);
            }
        }
    }
    Err(Error::Io(
        "digits.csv.gz not found: set KILN_DIGITS or keep ../shared/data beside the repository"
            .into(),
    ))
}

impl Digits {
    pub fn load(path: &Path) -> Result<Digits> {
        let file =
            std::fs::File::open(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        let mut text = String::new();
        flate2::read::GzDecoder::new(file)
            .read_to_string(&mut text)
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        let mut pixels = Vec::new();
        let mut labels = Vec::new();
        for (lineno, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let vals: Vec<f32> = line
                .split(',')
                .map(|v| v.trim().parse::<f32>())
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| Error::Io(format!("{} line {}: {e}", path.display(), lineno + 1)))?;
            if vals.len() != 65 {
                return Err(Error::Io(format!(
                    "{} line {}: expected 65 values, got {}",
                    path.display(),
                    lineno + 1,
                    vals.len()
                )));
            }
            pixels.extend(vals[..64].iter().map(|v| v / 16.0));
            labels.push(vals[64] as i64);
        }
        let n = labels.len();
        Ok(Digits {
            images: Tensor::from_vec(pixels, &[n, 64])?,
            labels: Tensor::from_vec(labels, &[n])?,
        })
    }

    pub fn len(&self) -> usize {
        self.labels.numel()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `1 - test_fraction` of rows for training, the rest held out (deterministic).
    pub fn split(&self, test_fraction: f64) -> Result<(Digits, Digits)> {
        let n = self.len();
        let n_test = ((n as f64) * test_fraction).round() as usize;
        let n_train = n - n_test;
        let part = |s: usize, len: usize| -> Result<Digits> {
            Ok(Digits {
                images: self.images.narrow(0, s, len)?.contiguous()?,
                labels: self.labels.narrow(0, s, len)?.contiguous()?,
            })
        };
        Ok((part(0, n_train)?, part(n_train, n_test)?))
    }

    /// Mini-batches of the rows in `order` (a permutation of 0..len).
    pub fn batches(&self, order: &[i64], batch: usize) -> Result<Vec<(Tensor, Tensor)>> {
        order
            .chunks(batch.max(1))
            .map(|idx| {
                let i = Tensor::from_slice(idx, &[idx.len()])?;
                Ok((
                    self.images.index_select(0, &i)?,
                    self.labels.index_select(0, &i)?,
                ))
            })
            .collect()
    }
}

/// A seeded permutation of 0..n (Fisher–Yates on a splitmix64 stream).
pub fn permutation(n: usize, seed: u64) -> Vec<i64> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    };
    let mut p: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}
