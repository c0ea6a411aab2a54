// Benchmark harness for River (our code, calling River's public API only).
//
// Usage:
//
//	river-bench setup  DSN                    apply River's migrations (rivermigrate)
//	river-bench work   DSN WORKERS [SETTING]  run a client with a no-op worker until SIGTERM/SIGINT
//	river-bench insert DSN COUNT BATCH        insert COUNT no-op jobs with InsertMany, BATCH per call
//
// SETTING "fair" (the default): the default queue with MaxWorkers WORKERS, the rest River's
// defaults. SETTING "throughput": the settings its docs benchmark with (docs/benchmarks, through
// the `river bench` command, cmd/river/riverbench/river_bench.go): MaxWorkers WORKERS (2,000
// there), FetchCooldown 2 ms and FetchPollInterval 20 ms.
//
// `work` prints "ready" once the client has started; `insert` prints "start <unix seconds>"
// right before its first insert, so connection set-up is not counted.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

type NoopArgs struct{}

func (NoopArgs) Kind() string { return "noop" }

type NoopWorker struct {
	river.WorkerDefaults[NoopArgs]
}

func (w *NoopWorker) Work(ctx context.Context, job *river.Job[NoopArgs]) error { return nil }

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "river-bench:", err)
		os.Exit(1)
	}
}

func atoi(s string) int {
	n, err := strconv.Atoi(s)
	must(err)
	return n
}

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: river-bench setup|work|insert DSN ...")
		os.Exit(2)
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Args[2])
	must(err)
	defer pool.Close()

	switch os.Args[1] {
	case "setup":
		migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
		must(err)
		_, err = migrator.Migrate(ctx, rivermigrate.DirectionUp, nil)
		must(err)
	case "work":
		workers := river.NewWorkers()
		river.AddWorker(workers, &NoopWorker{})
		config := &river.Config{
			Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: atoi(os.Args[3])}},
			Workers: workers,
		}
		setting := "fair"
		if len(os.Args) > 4 {
			setting = os.Args[4]
		}
		switch setting {
		case "fair":
		case "throughput":
			config.FetchCooldown = 2 * time.Millisecond
			config.FetchPollInterval = 20 * time.Millisecond
		default:
			fmt.Fprintln(os.Stderr, "unknown setting", setting)
			os.Exit(2)
		}
		client, err := river.NewClient(riverpgxv5.New(pool), config)
		must(err)
		must(client.Start(ctx))
		fmt.Println("ready")
		stop := make(chan os.Signal, 1)
		signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
		<-stop
		stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		must(client.Stop(stopCtx))
	case "insert":
		client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{})
		must(err)
		count, batch := atoi(os.Args[3]), atoi(os.Args[4])
		must(pool.Ping(ctx))
		fmt.Printf("start %.6f\n", float64(time.Now().UnixNano())/1e9)
		for done := 0; done < count; done += batch {
			n := min(batch, count-done)
			params := make([]river.InsertManyParams, n)
			for i := range params {
				params[i] = river.InsertManyParams{Args: NoopArgs{}}
			}
			_, err := client.InsertMany(ctx, params)
			must(err)
		}
	default:
		fmt.Fprintln(os.Stderr, "unknown command", os.Args[1])
		os.Exit(2)
	}
}
