from kvsieve.cli import app

if __name__ == "__main__":
    import sys

    app(["bench", "compiled", *sys.argv[1:]], prog_name="kvsieve")
