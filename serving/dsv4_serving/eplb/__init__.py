"""Expert-parallel load balancing (issue 17): placement, routing maps and live re-placement."""
