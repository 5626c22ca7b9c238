"""Code a pipeline folder brings with it: diffusers would import it; lifecycle never does."""

raise SystemExit("a pipeline folder's own code was imported")
