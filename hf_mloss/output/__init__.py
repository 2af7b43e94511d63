"""The output side: the merge result (result), model card (card), M-Loss report (report), weights
(checkpoint), plots and the Hub push (push)."""
