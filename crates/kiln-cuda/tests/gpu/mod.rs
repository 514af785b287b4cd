pub mod conv;
pub mod harness;
pub mod matmul;
pub mod modules;
