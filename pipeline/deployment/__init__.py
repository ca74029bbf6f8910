"""From a finished cross-validation to a model in use: the final model trained on every subject, the pain timeline of
any video, and export for other runtimes. Above the analyses: the final model takes its settings from a CV they
found."""
