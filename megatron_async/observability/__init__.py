"""What a run shows: MLflow tracking (`tracking`), the training plot (`plots`), console and log-file
set-up (`logs`) and the small step timer (`timing`)."""
