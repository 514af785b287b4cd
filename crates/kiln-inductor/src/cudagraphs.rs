//! The `cudagraphs` backend, as PyTorch's: no code generation — the captured graph runs on the
//! eager kernels (the interpreter), its forward and AOT backward each recorded once as a CUDA
//! graph and replayed (`runtime/cudagraph.rs`, the same recording `Mode::ReduceOverhead` puts
//! on generated kernels). What it saves is the host's per-op launch overhead, not memory traffic.
//! Graphs on the CPU have nothing to record: they run on the interpreter, with one notice.

use std::sync::{Arc, Once};

use kiln_compile::backends::Interpreter;
use kiln_compile::graph::Graph;
use kiln_compile::{Backend, BackendContext, CompiledGraph};
use kiln_core::{Device, Result};

use crate::runtime::cudagraph::CudaGraphed;

pub struct CudaGraphsBackend;

impl Backend for CudaGraphsBackend {
    fn name(&self) -> &str {
        "cudagraphs"
    }

    fn compile(&self, graph: &Graph, _ctx: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        let eager: Arc<dyn CompiledGraph> = Arc::new(Interpreter::new(graph.clone()));
        if graph.device() == Device::Cpu {
            static NOTICE: Once = Once::new();
            NOTICE.call_once(|| {
                eprintln!(
                    "kiln: backend \"cudagraphs\" records CUDA graphs; a graph on the CPU runs on \
                     the interpreter (eager kernels)"
                )
            });
            return Ok(eager);
        }
        Ok(Arc::new(CudaGraphed::new(eager, graph)))
    }
}
