"""tinyllm: transformer inference from scratch in numpy."""
