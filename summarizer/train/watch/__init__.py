"""The training loop's instruments: logging, FLOPs, module statistics, non-finite steps, loss spikes."""
