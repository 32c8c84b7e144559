// c2spcheck checks qualify's log artifacts with the Go reference code (golang.org/x/mod/sumdb/note and
// sumdb/tlog), an implementation independent of qualify's own. It reads one JSON request on stdin and
// writes one JSON answer: every check it was asked for, each "ok" or the reference code's error.
//
// Request fields: vkey (the log's verifier key), note (a signed checkpoint), records (base64 of every
// log entry's bytes, in index order), index + proof (an inclusion proof, base64 hashes, leaf sibling
// first), old_note + consistency (an older signed checkpoint and the proof from it to note).
package main

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

type request struct {
	Vkey        string   `json:"vkey"`
	Note        string   `json:"note"`
	Records     []string `json:"records"`
	Index       *int64   `json:"index"`
	Proof       []string `json:"proof"`
	OldNote     string   `json:"old_note"`
	Consistency []string `json:"consistency"`
	Sign        string   `json:"sign"` // a key name: generate a key, sign this note text with it
	SignText    string   `json:"sign_text"`
}

type checkpoint struct {
	origin string
	size   int64
	root   tlog.Hash
}

// parseCheckpoint reads a c2sp.org/tlog-checkpoint body: origin, decimal size, base64 root, extensions.
func parseCheckpoint(text string) (checkpoint, error) {
	var cp checkpoint
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	if len(lines) < 3 {
		return cp, errors.New("checkpoint has fewer than three lines")
	}
	size, err := strconv.ParseInt(lines[1], 10, 64)
	if err != nil || size < 0 || strconv.FormatInt(size, 10) != lines[1] {
		return cp, fmt.Errorf("bad tree size %q", lines[1])
	}
	root, err := tlog.ParseHash(lines[2])
	if err != nil {
		return cp, fmt.Errorf("bad root hash: %v", err)
	}
	return checkpoint{lines[0], size, root}, nil
}

func hashes(in []string) ([]tlog.Hash, error) {
	out := make([]tlog.Hash, len(in))
	for i, s := range in {
		h, err := tlog.ParseHash(s)
		if err != nil {
			return nil, err
		}
		out[i] = h
	}
	return out, nil
}

// open verifies a signed checkpoint with the verifier key and requires key name == origin, as a witness
// that looks the log's key up by the checkpoint's origin does.
func open(v note.Verifier, text string) (checkpoint, error) {
	n, err := note.Open([]byte(text), note.VerifierList(v))
	if err != nil {
		return checkpoint{}, err
	}
	cp, err := parseCheckpoint(n.Text)
	if err != nil {
		return cp, err
	}
	if cp.origin != v.Name() {
		return cp, fmt.Errorf("key name %q is not the checkpoint's origin %q", v.Name(), cp.origin)
	}
	return cp, nil
}

func result(err error) string {
	if err != nil {
		return err.Error()
	}
	return "ok"
}

func main() {
	var req request
	if err := json.NewDecoder(os.Stdin).Decode(&req); err != nil {
		fmt.Fprintln(os.Stderr, "bad request:", err)
		os.Exit(2)
	}
	out := map[string]string{}
	defer func() { _ = json.NewEncoder(os.Stdout).Encode(out) }()

	if req.Sign != "" {
		skey, vkey, err := note.GenerateKey(nil, req.Sign)
		if err != nil {
			out["sign"] = err.Error()
			return
		}
		s, err := note.NewSigner(skey)
		if err != nil {
			out["sign"] = err.Error()
			return
		}
		msg, err := note.Sign(&note.Note{Text: req.SignText}, s)
		out["sign"], out["skey"], out["vkey"], out["signed"] = result(err), skey, vkey, string(msg)
		return
	}

	v, err := note.NewVerifier(req.Vkey)
	out["vkey"] = result(err)
	if err != nil {
		return
	}
	cp, err := open(v, req.Note)
	out["checkpoint"] = result(err)
	if err != nil {
		return
	}
	if req.Records != nil {
		var stored []tlog.Hash
		err = nil
		for i, r := range req.Records {
			data, derr := base64.StdEncoding.DecodeString(r)
			if derr != nil {
				err = derr
				break
			}
			hs, serr := tlog.StoredHashes(int64(i), data, tlog.HashReaderFunc(func(idx []int64) ([]tlog.Hash, error) {
				got := make([]tlog.Hash, len(idx))
				for j, x := range idx {
					got[j] = stored[x]
				}
				return got, nil
			}))
			if serr != nil {
				err = serr
				break
			}
			stored = append(stored, hs...)
		}
		if err == nil {
			var root tlog.Hash
			root, err = tlog.TreeHash(int64(len(req.Records)), tlog.HashReaderFunc(func(idx []int64) ([]tlog.Hash, error) {
				got := make([]tlog.Hash, len(idx))
				for j, x := range idx {
					got[j] = stored[x]
				}
				return got, nil
			}))
			if err == nil && (int64(len(req.Records)) != cp.size || root != cp.root) {
				err = fmt.Errorf("the records hash to %v at size %d, the checkpoint says %v at %d", root, len(req.Records), cp.root, cp.size)
			}
		}
		out["records"] = result(err)
	}
	if req.Index != nil {
		p, perr := hashes(req.Proof)
		if perr == nil {
			data, derr := base64.StdEncoding.DecodeString(req.Records[*req.Index])
			if derr != nil {
				perr = derr
			} else {
				perr = tlog.CheckRecord(p, cp.size, cp.root, *req.Index, tlog.RecordHash(data))
			}
		}
		out["inclusion"] = result(perr)
	}
	if req.OldNote != "" {
		old, oerr := open(v, req.OldNote)
		if oerr == nil {
			var p []tlog.Hash
			p, oerr = hashes(req.Consistency)
			if oerr == nil {
				oerr = tlog.CheckTree(p, cp.size, cp.root, old.size, old.root)
			}
		}
		out["consistency"] = result(oerr)
	}
}
