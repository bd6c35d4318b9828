"""The model side of a rank: model loading, the runner, and each rank's process body."""
