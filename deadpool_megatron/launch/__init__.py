"""deadpool-launch: torchrun-shaped launcher with warm spares and a control plane."""
