pub mod conv;
pub mod conv_epilogue;
pub mod dtypes;
pub mod harness;
pub mod matmul;
pub mod modules;
