"""Reference backends in plain torch: correct on any device, the baseline for every other backend."""
