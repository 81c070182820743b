// CKKS bootstrapping (issue 15 item 1, the fhe mode of issue 17) over Lattigo v6.2.0's
// circuits/ckks/bootstrapping: ScaleDown, ModUp, CoeffsToSlots, EvalMod, SlotsToCoeffs
// (Bossuat, Troncoso-Pastoriza, Hubaux, Sousa, "Efficient Bootstrapping for Approximate
// Homomorphic Encryption with Non-Sparse Keys", EUROCRYPT 2021), with the sparse-secret
// encapsulation of Bossuat, Troncoso-Pastoriza, Hubaux, "Bootstrapping for Approximate
// Homomorphic Encryption with Negligible Failure-Probability by Using Sparse-Secret
// Encapsulation", ACNS 2022 (eprint 2022/024), which Lattigo's default parameters use.
//
// A bootstrappable context comes from a preset (clg_ckks_new_preset):
//
//	1  N16QP1546H192H32: Lattigo's default sparse set (residual Q 60 + 9 x 40 | P 5 x 61, secret
//	   Hamming weight 192, ephemeral weight 32, 2^15 slots; log2(QP) of the bootstrapping
//	   parameters 1546).  Key set: several GB, about a minute to generate.
//	0  TEST ONLY, INSECURE: LogN 10 (residual Q 60 + 9 x 40 | P 2 x 61, the bootstrapping
//	   circuit's own default chain on N = 2^10, far above any secure modulus), the message ratio
//	   raised by 16 - LogN as in Lattigo's own bootstrapping tests.  Refused unless the caller
//	   passes allowInsecure != 0; the Python side passes it only for allow_insecure_for_tests.
//
// Bootstrapping keys cross the wire in this package's own layout "CLGB" (fixed shapes derived
// from the parameters, every word checked reduced, exactly the required Galois elements).
package main

/*
#include <stdint.h>
#include <stdlib.h>
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"sync"

	"github.com/tuneinsight/lattigo/v6/circuits/ckks/bootstrapping"
	"github.com/tuneinsight/lattigo/v6/core/rlwe"
	"github.com/tuneinsight/lattigo/v6/ring"
	"github.com/tuneinsight/lattigo/v6/schemes/ckks"
	"github.com/tuneinsight/lattigo/v6/utils"
)

const (
	presetTestInsecure = 0
	presetN16QP1546    = 1
)

// btpPreset: what a bootstrappable context remembers about its preset.
type btpPreset struct {
	id       int
	lit      bootstrapping.ParametersLiteral
	testOnly bool
	once     sync.Once
	params   bootstrapping.Parameters
	err      error
}

func (b *btpPreset) parameters(residual ckks.Parameters) (bootstrapping.Parameters, error) {
	b.once.Do(func() { b.params, b.err = bootstrapping.NewParametersFromLiteral(residual, b.lit) })
	return b.params, b.err
}

// bootstrapParameters: the bootstrapping parameters of a bootstrappable context.
func (c *ctxObj) bootstrapParameters() (bootstrapping.Parameters, error) {
	if c.btp == nil {
		return bootstrapping.Parameters{}, errors.New("not a bootstrappable context (make it from a preset)")
	}
	return c.btp.parameters(c.params)
}

type btpObj struct {
	ctx    *ctxObj
	params bootstrapping.Parameters
	keys   *bootstrapping.EvaluationKeys
	mu     sync.Mutex // Lattigo's bootstrapping evaluator keeps internal buffers: one call at a time
	eval   *bootstrapping.Evaluator
}

func (o *btpObj) context() *ctxObj { return o.ctx }

// clg_ckks_new_preset: a bootstrappable CKKS context (see the file comment for the presets).
//
//export clg_ckks_new_preset
func clg_ckks_new_preset(preset C.int, allowInsecure C.int, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return call(errbuf, errlen, func() error {
		var lit ckks.ParametersLiteral
		var blit bootstrapping.ParametersLiteral
		test := false
		switch int(preset) {
		case presetN16QP1546:
			lit = bootstrapping.N16QP1546H192H32.SchemeParams
			blit = bootstrapping.N16QP1546H192H32.BootstrappingParams
		case presetTestInsecure:
			if allowInsecure == 0 {
				return errors.New("the LogN-10 bootstrapping preset is insecure and for tests only")
			}
			test = true
			lit = ckks.ParametersLiteral{
				LogN:            10,
				LogQ:            []int{60, 40, 40, 40, 40, 40, 40, 40, 40, 40},
				LogP:            []int{61, 61},
				Xs:              ring.Ternary{H: 192},
				LogDefaultScale: 40,
			}
			blit = bootstrapping.ParametersLiteral{
				LogN:            utils.Pointy(10),
				LogSlots:        utils.Pointy(9),
				LogMessageRatio: utils.Pointy(bootstrapping.DefaultLogMessageRatio + 16 - 10),
			}
		default:
			return fmt.Errorf("unknown bootstrapping preset %d", int(preset))
		}
		params, err := ckks.NewParametersFromLiteral(lit)
		if err != nil {
			return err
		}
		c := &ctxObj{params: params, encoder: newEncoder(params), eval: ckks.NewEvaluator(params, nil),
			btp: &btpPreset{id: int(preset), lit: blit, testOnly: test}}
		if _, err := c.btp.parameters(params); err != nil {
			return err
		}
		*out = C.int64_t(put(c))
		return nil
	})
}

// clg_btp_ctx_info: for a bootstrappable context: log2(QP) of the bootstrapping parameters (the
// largest modulus any key lives under), the secret's Hamming weight (0: uniform ternary), the
// ephemeral secret's weight, log2 of the slots the bootstrapping handles, 1 for the test preset.
//
//export clg_btp_ctx_info
func clg_btp_ctx_info(h C.int64_t, logQP *C.double, hw *C.int, ephemeral *C.int, logSlots *C.int, testOnly *C.int,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		bp, err := c.bootstrapParameters()
		if err != nil {
			return err
		}
		*logQP = C.double(max(bp.BootstrappingParameters.LogQP(), c.params.LogQP()))
		*hw = 0
		if t, ok := c.params.Xs().(ring.Ternary); ok && t.H > 0 {
			*hw = C.int(t.H)
		}
		*ephemeral = C.int(bp.EphemeralSecretWeight)
		*logSlots = C.int(bp.LogMaxSlots())
		*testOnly = 0
		if c.btp.testOnly {
			*testOnly = 1
		}
		return nil
	})
}

func newBtpObj(c *ctxObj, bp bootstrapping.Parameters, keys *bootstrapping.EvaluationKeys) (*btpObj, error) {
	ev, err := bootstrapping.NewEvaluator(bp, keys)
	if err != nil {
		return nil, err
	}
	// EvalMod's polynomial (products, relinearisations, rescales) on the AVX-512 NTTs
	// (fastops.go); the DFTs' linear transforms keep Lattigo's own
	if m := ev.Mod1Evaluator; m != nil && m.PolynomialEvaluator != nil && m.Evaluator != nil {
		m.PolynomialEvaluator.Evaluator.Evaluator = fastEvaluator{m.Evaluator}
	}
	return &btpObj{ctx: c, params: bp, keys: keys, eval: ev}, nil
}

// clg_btp_keygen: the bootstrapping keys of the secret key (relinearisation, the circuit's
// Galois keys, the sparse-secret encapsulation keys) and an evaluator over them.
//
//export clg_btp_keygen
func clg_btp_keygen(skh C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(skh, "secret key", errbuf, errlen, func(s *skObj) error {
		bp, err := s.ctx.bootstrapParameters()
		if err != nil {
			return err
		}
		if bp.BootstrappingParameters.N() != s.ctx.params.N() || s.ctx.params.RingType() != ring.Standard {
			return errors.New("only same-degree, standard-ring bootstrapping is wrapped")
		}
		keys, _, err := bp.GenEvaluationKeys(s.sk)
		if err != nil {
			return err
		}
		b, err := newBtpObj(s.ctx, bp, keys)
		if err != nil {
			return err
		}
		*out = C.int64_t(put(b))
		return nil
	})
}

// clg_btp_info: output level, depth of the circuit, the keys' size in Lattigo's binary
// serialisation (bytes) and the number of Galois keys.
//
//export clg_btp_info
func clg_btp_info(h C.int64_t, outLevel *C.int, depth *C.int, keyBytes *C.int64_t, nGalois *C.int,
	errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "bootstrapping key set", errbuf, errlen, func(b *btpObj) error {
		*outLevel = C.int(b.eval.OutputLevel())
		*depth = C.int(b.eval.Depth())
		*keyBytes = C.int64_t(b.keys.BinarySize())
		*nGalois = C.int(len(b.keys.GaloisKeys))
		return nil
	})
}

// clg_btp_free: release a bootstrapping key set now and return the memory to the OS (a key set
// at N = 2^16 holds several GB).
//
//export clg_btp_free
func clg_btp_free(h C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "bootstrapping key set", errbuf, errlen, func(b *btpObj) error {
		b.mu.Lock()
		b.eval, b.keys = nil, nil
		b.mu.Unlock()
		clg_free(h)
		debug.FreeOSMemory()
		return nil
	})
}

// clg_bootstrap: a fresh-level re-encryption of ct (output at the residual parameters' top level,
// the context's default scale).
//
//export clg_bootstrap
func clg_bootstrap(bh C.int64_t, cth C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with2(bh, "bootstrapping key set", cth, "ciphertext", "ciphertext and bootstrapping keys belong to different contexts",
		errbuf, errlen, func(b *btpObj, c *ctObj) error {
			if c.ct.Degree() != 1 {
				return errors.New("bootstrapping needs a degree-1 ciphertext (relinearise first)")
			}
			if c.ct.LogDimensions.Cols > b.params.LogMaxSlots() {
				return fmt.Errorf("ciphertext with 2^%d slots, the bootstrapping handles 2^%d",
					c.ct.LogDimensions.Cols, b.params.LogMaxSlots())
			}
			b.mu.Lock()
			defer b.mu.Unlock()
			if b.eval == nil {
				return errors.New("bootstrapping key set already freed")
			}
			res, err := b.eval.Bootstrap(c.ct.CopyNew())
			if err != nil {
				return err
			}
			*out = C.int64_t(put(&ctObj{ctx: c.ctx, ct: res}))
			return nil
		})
}

// ----------------------------------------------------------------------------- wire layout

// btpTemplate: empty keys with the shapes GenEvaluationKeys produces for these parameters, and
// the Galois elements the circuit needs (sorted).
func btpTemplate(bp bootstrapping.Parameters) (d2s, s2d *rlwe.EvaluationKey, rlk *rlwe.RelinearizationKey, els []uint64, err error) {
	pN2 := bp.BootstrappingParameters
	if bp.EphemeralSecretWeight != 0 {
		var pSparse rlwe.Parameters
		pSparse, err = rlwe.NewParametersFromLiteral(rlwe.ParametersLiteral{
			LogN: pN2.LogN(), Q: pN2.Q()[:1], P: pN2.P()[:1]})
		if err != nil {
			return
		}
		d2s = rlwe.NewEvaluationKey(pSparse)
		s2d = rlwe.NewEvaluationKey(pN2)
	}
	rlk = rlwe.NewRelinearizationKey(pN2)
	for _, g := range append(bp.GaloisElements(pN2), pN2.GaloisElementForComplexConjugation()) {
		if !slices.Contains(els, g) {
			els = append(els, g)
		}
	}
	slices.Sort(els)
	return
}

func sameShape(a, b *rlwe.EvaluationKey) bool {
	pa, pb := evkPolys(a), evkPolys(b)
	if len(pa) != len(pb) {
		return false
	}
	for i := range pa {
		if len(pa[i].Coeffs) != len(pb[i].Coeffs) || polysWords(pa[i:i+1]) != polysWords(pb[i:i+1]) {
			return false
		}
	}
	return true
}

// clg_btp_keys_to_bytes: "CLGB" | version | flags (1: encapsulation keys present) | 0 0 |
// u32 number of Galois keys | [dense->sparse key | sparse->dense key] | relinearisation key |
// per Galois key (ascending element): u64 element | key words.  Expanded keys (no seeds).
//
//export clg_btp_keys_to_bytes
func clg_btp_keys_to_bytes(h C.int64_t, out **C.uchar, outLen *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "bootstrapping key set", errbuf, errlen, func(b *btpObj) error {
		b.mu.Lock()
		defer b.mu.Unlock()
		if b.keys == nil {
			return errors.New("bootstrapping key set already freed")
		}
		k := b.keys
		if k.EvkN1ToN2 != nil || k.EvkN2ToN1 != nil || k.EvkRealToCmplx != nil || k.EvkCmplxToReal != nil {
			return errors.New("ring-switching bootstrapping keys are not serialised")
		}
		d2s, s2d, rlk, els, err := btpTemplate(b.params)
		if err != nil {
			return err
		}
		flags := byte(0)
		if d2s != nil {
			flags = 1
			if k.EvkDenseToSparse == nil || k.EvkSparseToDense == nil ||
				!sameShape(k.EvkDenseToSparse, d2s) || !sameShape(k.EvkSparseToDense, s2d) {
				return errors.New("encapsulation keys do not have the expected shape")
			}
		}
		if k.RelinearizationKey == nil || !sameShape(&k.RelinearizationKey.EvaluationKey, &rlk.EvaluationKey) {
			return errors.New("relinearisation key missing or of an unexpected shape")
		}
		have := k.GetGaloisKeysList()
		slices.Sort(have)
		if !slices.Equal(have, els) {
			return errors.New("the key set's Galois elements are not the circuit's")
		}
		buf := []byte{'C', 'L', 'G', 'B', wireVersion, flags, 0, 0}
		buf = binary.LittleEndian.AppendUint32(buf, uint32(len(els)))
		if flags == 1 {
			buf = writePolys(buf, evkPolys(k.EvkDenseToSparse))
			buf = writePolys(buf, evkPolys(k.EvkSparseToDense))
		}
		buf = writePolys(buf, evkPolys(&k.RelinearizationKey.EvaluationKey))
		for _, g := range els {
			buf = binary.LittleEndian.AppendUint64(buf, g)
			buf = writePolys(buf, gkPolys(k.GaloisKeys[g]))
		}
		bytesOut(buf, out, outLen)
		return nil
	})
}

// clg_btp_keys_from_bytes: validate and load a peer's bootstrapping keys for a bootstrappable
// context (length checked before any allocation; exactly the circuit's Galois elements).
//
//export clg_btp_keys_from_bytes
func clg_btp_keys_from_bytes(h C.int64_t, buf *C.uchar, n C.int64_t, out *C.int64_t, errbuf *C.char, errlen C.int) (rc C.int) {
	return with(h, "context", errbuf, errlen, func(c *ctxObj) error {
		bp, err := c.bootstrapParameters()
		if err != nil {
			return err
		}
		d2s, s2d, rlk, els, err := btpTemplate(bp)
		if err != nil {
			return err
		}
		pN2 := bp.BootstrappingParameters
		gkWords := polysWords(gkPolys(rlwe.NewGaloisKey(pN2)))
		want := keyHeader + 4 + 8*polysWords(evkPolys(&rlk.EvaluationKey)) + len(els)*(8+8*gkWords)
		flags := byte(0)
		if d2s != nil {
			flags = 1
			want += 8 * (polysWords(evkPolys(d2s)) + polysWords(evkPolys(s2d)))
		}
		b := bytesIn(buf, n)
		if len(b) != want {
			return fmt.Errorf("bootstrapping key blob of %d bytes, expected %d", len(b), want)
		}
		if string(b[:4]) != "CLGB" || b[4] != wireVersion || b[5] != flags || b[6] != 0 || b[7] != 0 {
			return errors.New("not a cipherlm/Lattigo bootstrapping key set (bad header)")
		}
		if int(binary.LittleEndian.Uint32(b[8:12])) != len(els) {
			return fmt.Errorf("%d Galois keys, the circuit needs %d", binary.LittleEndian.Uint32(b[8:12]), len(els))
		}
		q, p := pN2.Q(), pN2.P()
		rest := b[keyHeader+4:]
		if d2s != nil {
			if rest, err = readEvk(d2s, q, p, rest); err != nil {
				return err
			}
			if rest, err = readEvk(s2d, q, p, rest); err != nil {
				return err
			}
		}
		if rest, err = readEvk(&rlk.EvaluationKey, q, p, rest); err != nil {
			return err
		}
		gks := make([]*rlwe.GaloisKey, 0, len(els))
		for _, g := range els {
			if got := binary.LittleEndian.Uint64(rest[:8]); got != g {
				return fmt.Errorf("Galois element %d where %d was expected", got, g)
			}
			rest = rest[8:]
			gk := rlwe.NewGaloisKey(pN2)
			gk.GaloisElement = g
			if rest, err = readEvk(&gk.EvaluationKey, q, p, rest); err != nil {
				return err
			}
			gks = append(gks, gk)
		}
		keys := &bootstrapping.EvaluationKeys{
			EvkDenseToSparse:    d2s,
			EvkSparseToDense:    s2d,
			MemEvaluationKeySet: rlwe.NewMemEvaluationKeySet(rlk, gks...),
		}
		bo, err := newBtpObj(c, bp, keys)
		if err != nil {
			return err
		}
		*out = C.int64_t(put(bo))
		return nil
	})
}
