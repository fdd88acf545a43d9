from retrain.run.stop_request import exit_quietly_on_interrupt

exit_quietly_on_interrupt()  # before the heavy imports: Ctrl-C during them exits 130 quietly

from retrain.cli.app import main  # noqa: E402

if __name__ == "__main__":
    main()
