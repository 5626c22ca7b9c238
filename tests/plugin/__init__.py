"""An out-of-tree plugin package: kinds and a backend that reach the project by entry points."""
