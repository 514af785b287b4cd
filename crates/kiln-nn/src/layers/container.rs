//! `nn.Sequential` and `nn.ModuleList`: children named by position ("0", "1", ..), so parameter
//! names match PyTorch's (`0.weight`, `layers.3.bias`).

use std::ops::Index;

use kiln_core::{Error, Result, Tensor};

use crate::module::{Module, TrainFlag};

/// Runs its children in order, each on the previous one's output.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
    training: TrainFlag,
}

impl Sequential {
    pub fn new() -> Self {
        Self::default()
    }
    /// Builder form: `Sequential::new().add(Linear::new(..)?).add(ReLU::new())`.
    #[allow(clippy::should_implement_trait)]
    pub fn add<M: Module + 'static>(mut self, m: M) -> Self {
        self.push(m);
        self
    }
    pub fn push<M: Module + 'static>(&mut self, m: M) {
        self.layers.push(Box::new(m));
    }
    pub fn push_boxed(&mut self, m: Box<dyn Module>) {
        self.layers.push(m);
    }
    pub fn len(&self) -> usize {
        self.layers.len()
    }
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
    pub fn get(&self, i: usize) -> Option<&dyn Module> {
        self.layers.get(i).map(|m| &**m)
    }
    pub fn iter(&self) -> impl Iterator<Item = &dyn Module> {
        self.layers.iter().map(|m| &**m)
    }
}

impl FromIterator<Box<dyn Module>> for Sequential {
    fn from_iter<I: IntoIterator<Item = Box<dyn Module>>>(iter: I) -> Self {
        Sequential {
            layers: iter.into_iter().collect(),
            training: TrainFlag::default(),
        }
    }
}

impl Index<usize> for Sequential {
    type Output = dyn Module;
    fn index(&self, i: usize) -> &Self::Output {
        &*self.layers[i]
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.clone();
        for m in &self.layers {
            y = m.forward(&y)?;
        }
        Ok(y)
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, m)| (i.to_string(), &**m))
            .collect()
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        self.layers
            .iter_mut()
            .enumerate()
            .map(|(i, m)| (i.to_string(), &mut **m as &mut dyn Module))
            .collect()
    }
}

/// Holds submodules for the parent to call as it likes; it has no forward of its own.
#[derive(Default)]
pub struct ModuleList {
    modules: Vec<Box<dyn Module>>,
    training: TrainFlag,
}

impl ModuleList {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn push<M: Module + 'static>(&mut self, m: M) {
        self.modules.push(Box::new(m));
    }
    pub fn push_boxed(&mut self, m: Box<dyn Module>) {
        self.modules.push(m);
    }
    pub fn len(&self) -> usize {
        self.modules.len()
    }
    pub fn is_empty(&self) -> bool {
        self.modules.is_empty()
    }
    pub fn get(&self, i: usize) -> Option<&dyn Module> {
        self.modules.get(i).map(|m| &**m)
    }
    pub fn iter(&self) -> impl Iterator<Item = &dyn Module> {
        self.modules.iter().map(|m| &**m)
    }
}

impl FromIterator<Box<dyn Module>> for ModuleList {
    fn from_iter<I: IntoIterator<Item = Box<dyn Module>>>(iter: I) -> Self {
        ModuleList {
            modules: iter.into_iter().collect(),
            training: TrainFlag::default(),
        }
    }
}

impl Index<usize> for ModuleList {
    type Output = dyn Module;
    fn index(&self, i: usize) -> &Self::Output {
        &*self.modules[i]
    }
}

impl Module for ModuleList {
    /// A ModuleList is a container, not a layer (PyTorch raises NotImplementedError).
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        Err(Error::unsupported(
            "ModuleList",
            "ModuleList has no forward; iterate over its modules in the parent's forward",
        ))
    }
    fn train_flag(&self) -> &TrainFlag {
        &self.training
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        self.modules
            .iter()
            .enumerate()
            .map(|(i, m)| (i.to_string(), &**m))
            .collect()
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        self.modules
            .iter_mut()
            .enumerate()
            .map(|(i, m)| (i.to_string(), &mut **m as &mut dyn Module))
            .collect()
    }
}
