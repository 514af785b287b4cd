//! ResNet (torchvision architecture and state-dict key names).
