"""What the model is asked and how it is scored: prompt sources (tasks), answers, rewards and the
worker process that scores them."""
