//! Source generation from the schedule. `c`: C with OpenMP for the CPU.

pub mod c;
pub mod template;
