"""Device backends behind one protocol: cpu, sim (simulated GPUs) and cupy."""
