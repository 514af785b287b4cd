//! The loop-level IR: index expressions (`index`) and how prims lower onto them (`lower`).

pub mod index;
pub mod lower;
