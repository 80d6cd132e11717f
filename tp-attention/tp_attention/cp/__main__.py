from tp_attention.cp.study import main

if __name__ == "__main__":
    main()
