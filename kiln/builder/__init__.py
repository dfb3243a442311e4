"""Engine spec, validation, weight preparation and the atomic engine writer."""
