"""What distillation buys: a student's exact-match accuracy on a task with a right answer, against steps and
GPU-seconds, recipe by recipe and beside TRL's trainers."""
