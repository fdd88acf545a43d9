"""The USL back-pressure controller (controller), its decisions, explorations and saved state.
Pure like all of control/: may import only control's other modules, config and the standard
library."""
